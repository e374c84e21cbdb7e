"""summary.json, the text and the HTML report, built from collected results."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta

import pytest

from qmq_reconcile.report import (
    LISTED_OUT_OF_ORDER,
    LISTED_REGIONS,
    RunInfo,
    acked_entry,
    exit_code,
    out_of_order_entry,
    render_html,
    render_text,
    summary,
    unreadable_entry,
)
from qmq_reconcile.transforms import CATEGORIES

pytestmark = pytest.mark.spark

INFO = RunInfo(
    started_at=datetime(2025, 1, 1, tzinfo=UTC),
    outboxes=["postgresql+psycopg://app:***@db/app"],
    broker_dirs=["/data/b1"],
    since=None,
    until=None,
    settled_before=datetime(2025, 1, 1, tzinfo=UTC) - timedelta(minutes=5),
    grace_s=300,
    ack_threshold_s=600,
    producers=None,
)
GROUPS = [
    {
        "subject": "orders",
        "group": "<billing>",
        "mode": "shared",
        "acked": 3,
        "unacked_past_threshold": 1,
        "dead_letters": 2,
        "never_acked": False,
    }
]
LATENCY = [
    {"metric": "created_to_stored", "count": 10, "p50": 1.5, "p90": 2.0, "p99": 3.0, "max": 4.0}
]


def test_summary_has_every_category_and_the_exit_code() -> None:
    doc = summary({"delivered": 7, "stuck_pending": 1}, GROUPS, LATENCY)
    assert list(doc) == [
        "categories",
        "categories_judged",
        "unreadable_in_broker",
        "out_of_order",
        "groups",
        "latency_ms",
        "consumed",
        "exit_code",
    ]
    assert doc["categories_judged"] is True
    assert doc["consumed"] is None  # no --consumed check asked for
    assert list(doc["categories"]) == list(CATEGORIES)
    assert doc["unreadable_in_broker"] == {"count": 0, "bytes": 0, "regions": []}
    nothing = {"count": 0, "keys": 0, "messages": []}
    assert doc["out_of_order"] == {**nothing, "acked": nothing}
    assert doc["categories"]["delivered"] == 7
    assert doc["categories"]["orphan_in_broker"] == 0
    assert doc["exit_code"] == 0
    assert doc["groups"]["orders"]["<billing>"]["dead_letters"] == 2
    assert doc["latency_ms"]["created_to_stored"]["p50"] == 1.5
    assert doc["latency_ms"]["stored_to_acked"] == {
        "count": 0,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
    }


@pytest.mark.parametrize(
    ("category", "code"),
    [
        ("delivered", 0),
        ("stuck_pending", 0),
        ("pending_but_stored", 0),
        ("dead_in_outbox", 0),
        ("missing_in_broker", 1),
        ("orphan_in_broker", 1),
        ("body_mismatch", 1),
        ("duplicate_in_broker", 1),
    ],
)
def test_exit_code_is_1_for_critical_categories(category: str, code: int) -> None:
    assert exit_code({category: 1}) == code


def test_text_report() -> None:
    text = render_text(summary({"missing_in_broker": 2}, GROUPS, LATENCY), INFO)
    assert re.search(r"missing_in_broker\s+2\s+CRITICAL", text)
    assert "orders/<billing>" in text
    assert "result: 2 critical finding(s) -> exit 1" in text


def test_the_window_in_plain_words() -> None:
    text = render_text(summary({}, [], []), INFO)
    assert "checked:      outbox rows and broker messages created at any time\n" in text
    assert (
        "not judged:   messages created or due after 2024-12-31T23:55:00Z (grace 5 min): "
        "still in flight\n"
    ) in text
    since, until = datetime(2024, 12, 1, tzinfo=UTC), datetime(2024, 12, 2, tzinfo=UTC)
    bounded = {
        (since, None): "created at any time from 2024-12-01T00:00:00Z on",
        (None, until): "created at any time before 2024-12-02T00:00:00Z",
        (since, until): "created between 2024-12-01T00:00:00Z and 2024-12-02T00:00:00Z",
    }
    for (start, end), words in bounded.items():
        info = dataclasses.replace(INFO, since=start, until=end)
        assert f"broker messages {words}\n" in render_text(summary({}, [], []), info)
        assert words in render_html(summary({}, [], []), info, {})
    assert "unacked past 10 min" in text


def test_html_report_is_self_contained_and_escaped() -> None:
    page = render_html(
        summary({"delivered": 1}, GROUPS, LATENCY),
        INFO,
        {"created_to_stored": {1: 4, 3: 8}},
    )
    assert "&lt;billing&gt;" in page
    assert "<billing>" not in page
    assert not re.search(r"(src|href)=", page)
    assert "< 5 ms" not in page  # labels are escaped too
    assert "&lt; 5 ms" in page
    assert page.count('<div style="width:') == 3  # buckets 1..3, the empty one included
    assert "<h2>Unreadable in broker data</h2>\n<p>none</p>" in page
    assert "<h2>Stored out of order</h2>\n<p>none</p>" in page


REGION = {"broker": "/data/<b1>", "log": "messages", "segment": 4, "offset": 1234, "length": 97}


def test_unreadable_regions_are_a_warning_with_their_place() -> None:
    damage = unreadable_entry(1, 97, [REGION])
    doc = summary({"delivered": 3}, GROUPS, LATENCY, damage)
    assert doc["unreadable_in_broker"] == {"count": 1, "bytes": 97, "regions": [REGION]}
    assert doc["exit_code"] == 0
    text = render_text(doc, INFO)
    assert re.search(r"unreadable_in_broker\s+1\s+WARNING\s+\(97 bytes\)", text)
    assert "/data/<b1> messages segment 4 offset 1234 length 97" in text
    assert "result: clean; 1 unreadable region(s) in broker data -> exit 0" in text
    page = render_html(doc, INFO, {})
    assert "<td>/data/&lt;b1&gt;</td><td>messages</td><td>4</td><td>1234</td><td>97</td>" in page


def test_unreadable_regions_listed_are_capped() -> None:
    regions = [{**REGION, "offset": n} for n in range(LISTED_REGIONS + 5)]
    damage = unreadable_entry(len(regions), 97 * len(regions), regions)
    assert len(damage["regions"]) == LISTED_REGIONS
    text = render_text(summary({}, [], [], damage), INFO)
    assert "... 5 more in unreadable_in_broker/" in text


DISORDER = {
    "subject": "ledger",
    "key": "<acct-1>",
    "message_id": "m2",
    "outbox": "db1",
    "outbox_id": 2,
    "broker": "/data/b1",
    "partition": 3,
    "seq": 7,
    "stored_at": datetime(2025, 1, 1, 11, tzinfo=UTC),
    "after_id": "m3",
    "after_outbox_id": 3,
}


def test_out_of_order_is_a_warning_listed_by_key() -> None:
    disorder = out_of_order_entry(1, 1, [DISORDER])
    doc = summary({"delivered": 3}, GROUPS, LATENCY, None, disorder)
    assert doc["out_of_order"] == {
        "count": 1,
        "keys": 1,
        "messages": [{**DISORDER, "stored_at": "2025-01-01T11:00:00Z"}],
        "acked": {"count": 0, "keys": 0, "messages": []},
    }
    assert doc["exit_code"] == 0
    text = render_text(doc, INFO)
    assert re.search(r"out_of_order\s+1\s+WARNING\s+\(1 key\(s\)\)", text)
    assert (
        "ledger key <acct-1>: m2 (outbox id 2) stored after m3 (outbox id 3), "
        "/data/b1 partition 3 seq 7"
    ) in text
    assert "result: clean; 1 message(s) stored out of order -> exit 0" in text
    page = render_html(doc, INFO, {})
    assert "<td>ledger</td><td>&lt;acct-1&gt;</td><td>m2</td>" in page


def test_out_of_order_listed_are_capped() -> None:
    many = [{**DISORDER, "seq": n, "partition": None} for n in range(LISTED_OUT_OF_ORDER + 2)]
    disorder = out_of_order_entry(len(many), 1, many)
    assert len(disorder["messages"]) == LISTED_OUT_OF_ORDER
    text = render_text(summary({}, [], [], None, disorder), INFO)
    assert "... 2 more in out_of_order/" in text
    assert "/data/b1 seq 0\n" in text  # a plain subject's message has no partition


ACKED_DISORDER = {
    "subject": "ledger",
    "group": "<billing>",
    "key": "acct-1",
    "message_id": "m3",
    "broker": "/data/b1",
    "partition": 3,
    "seq": 8,
    "stored_at": datetime(2025, 1, 1, 11, tzinfo=UTC),
    "acked_at": datetime(2025, 1, 1, 11, 1, tzinfo=UTC),
    "earlier_id": "m2",
    "earlier_acked_at": datetime(2025, 1, 1, 11, 2, tzinfo=UTC),
}


def test_acked_out_of_order_is_a_warning_of_its_own() -> None:
    disorder = out_of_order_entry(0, 0, [], acked=acked_entry(1, 1, [ACKED_DISORDER]))
    doc = summary({"delivered": 3}, GROUPS, LATENCY, None, disorder)
    assert doc["out_of_order"]["count"] == 0
    assert doc["out_of_order"]["acked"] == {
        "count": 1,
        "keys": 1,
        "messages": [
            {
                **ACKED_DISORDER,
                "stored_at": "2025-01-01T11:00:00Z",
                "acked_at": "2025-01-01T11:01:00Z",
                "earlier_acked_at": "2025-01-01T11:02:00Z",
            }
        ],
    }
    assert doc["exit_code"] == 0
    text = render_text(doc, INFO)
    assert re.search(r"out_of_order\s+0\s+warning", text)
    assert re.search(r"out_of_order_acked\s+1\s+WARNING\s+\(1 key\(s\)\)", text)
    assert (
        "ledger group <billing> key acct-1: m3 (/data/b1 partition 3 seq 8) acked at "
        "2025-01-01T11:01:00Z, before m2 stored ahead of it (acked at 2025-01-01T11:02:00Z)"
    ) in text
    assert "result: clean; 1 message(s) acked out of order -> exit 0" in text
    page = render_html(doc, INFO, {})
    assert "<h2>Acked out of order</h2>" in page
    assert "<td>ledger</td><td>&lt;billing&gt;</td><td>acct-1</td><td>m3</td>" in page
