"""Tags and server-side tag filters against real broker processes (issue 39, tags).

A group filtering one tag of four gets exactly that quarter, and the other three quarters
cost it no pull, lease or ack (the broker's own counters say so); the filter survives a
kill -9; a changed filter is 409; bad tags are 400 naming the field.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.broker_process import BrokerProcess
from tests.support.metrics import metric

COLOURS = ("red", "green", "blue", "gold")


@pytest.fixture
def broker(broker_factory: type[BrokerProcess], tmp_path: Path) -> BrokerProcess:
    return broker_factory(tmp_path / "data").start()


@pytest.fixture
def http(broker: BrokerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=broker.url, timeout=10) as c:
        yield c


def post(http: httpx.Client, path: str, doc: Any) -> httpx.Response:
    return http.post(path, content=orjson.dumps(doc), headers={"content-type": "application/json"})


def produce(http: httpx.Client, count: int, *, first: int = 0) -> None:
    """Messages ``first..first+count-1``, message i tagged with ``COLOURS[i % 4]`` (and every
    tenth one ``audit`` too)."""
    messages = []
    for i in range(first, first + count):
        tags = [COLOURS[i % 4], *(["audit"] if i % 10 == 0 else [])]
        messages.append({"id": f"m-{i}", "subject": "orders", "body": f"b{i}", "tags": tags})
    answer = post(http, "/v1/messages", {"messages": messages})
    assert answer.status_code == 200, answer.text
    assert {r["status"] for r in answer.json()["results"]} == {"stored"}


def pull(
    http: httpx.Client, group: str, tags: list[str] | None, *, ack: list[int] | None = None
) -> httpx.Response:
    doc: dict[str, Any] = {"subject": "orders", "group": group, "consumer": "c1", "max": 16}
    if tags is not None:
        doc["tags"] = tags
    if ack:
        doc["ack"] = ack
    return post(http, "/v1/pull", doc)


def drain(http: httpx.Client, group: str, tags: list[str] | None) -> tuple[list[Any], int]:
    """Every message the group is served, each acked by the next pull; and the pulls made."""
    served: list[Any] = []
    ack: list[int] | None = None
    pulls = 0
    while True:
        answer = pull(http, group, tags, ack=ack)
        pulls += 1
        assert answer.status_code == 200, answer.text
        messages = answer.json()["messages"]
        if not messages:
            return served, pulls
        served.extend(messages)
        ack = [m["seq"] for m in messages]


def group_stats(http: httpx.Client, group: str) -> dict[str, Any]:
    groups = http.get("/v1/subjects/orders").json()["groups"]
    found: dict[str, Any] = next(g for g in groups if g["group"] == group)
    return found


def test_a_group_filtering_one_tag_of_four_gets_that_quarter_and_pays_for_nothing_else(
    broker: BrokerProcess, http: httpx.Client
) -> None:
    produce(http, 200)
    served, pulls = drain(http, "reds", ["red"])

    assert [m["id"] for m in served] == [f"m-{i}" for i in range(0, 200, 4)]
    assert all("red" in m["tags"] for m in served)
    assert all(m["attempt"] == 1 for m in served)
    # 50 messages in pulls of 16: four pulls with messages and the empty one that ended it.
    # Unfiltered, the same group would have needed 13 pulls to see the 200.
    assert pulls == 5
    assert metric(broker.url, "qmq_broker_request_seconds_count", endpoint="pull") == 5
    assert metric(broker.url, "qmq_broker_pulled_messages_total") == 50  # leased and served
    assert metric(broker.url, "qmq_broker_acked_messages_total") == 50
    assert metric(broker.url, "qmq_broker_request_seconds_count", endpoint="ack") == 0
    assert metric(broker.url, "qmq_broker_filtered_messages_total") == 150
    assert metric(broker.url, "qmq_broker_group_filtered_messages", group="reds") == 150
    stats = group_stats(http, "reds")
    assert stats["tags"] == ["red"]
    assert (stats["acked"], stats["filtered"], stats["in_flight"], stats["backlog"]) == (
        50,
        150,
        0,
        0,
    )

    # any-of: a message with either tag; an unfiltered group still gets all 200
    audits, _ = drain(http, "audit-or-gold", ["gold", "audit"])
    wanted = [i for i in range(200) if i % 4 == 3 or i % 10 == 0]
    assert [m["id"] for m in audits] == [f"m-{i}" for i in wanted]
    everything, _ = drain(http, "all", None)
    assert len(everything) == 200
    assert group_stats(http, "all")["filtered"] == 0
    assert group_stats(http, "all")["tags"] == []


def test_the_filter_and_its_skips_survive_kill_9(broker: BrokerProcess, http: httpx.Client) -> None:
    produce(http, 40)
    first = pull(http, "blues", ["blue"])
    assert [m["id"] for m in first.json()["messages"]] == [f"m-{i}" for i in range(2, 40, 4)]
    done = [m["seq"] for m in first.json()["messages"]]
    assert pull(http, "blues", ["blue"], ack=done).json()["messages"] == []
    broker.kill9()
    broker.start()

    # the filter is still the group's: another is refused, the same one goes on
    refused = pull(http, "blues", ["red"])
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "tags_conflict"
    assert refused.json()["error"]["field"] == "tags"
    stats = group_stats(http, "blues")
    assert (stats["acked"], stats["filtered"], stats["tags"]) == (10, 30, ["blue"])
    produce(http, 40, first=40)
    served, _ = drain(http, "blues", ["blue"])
    assert [m["id"] for m in served] == [f"m-{i}" for i in range(42, 80, 4)]
    assert group_stats(http, "blues")["filtered"] == 60

    # a filter fixed by a group's first pull, then a crash before anything else
    assert pull(http, "greens", ["green"]).status_code == 200
    broker.kill9()
    broker.start()
    assert pull(http, "greens", None).json()["error"]["code"] == "tags_conflict"
    served, _ = drain(http, "greens", ["green"])
    # Its first pull leased 16 of the 20 greens; a lease is durable per --ack-fsync, so
    # the crash may have cost it (they are served again): either way greens only, all 20.
    greens = [f"m-{i}" for i in range(1, 80, 4)]
    assert {m["id"] for m in served} <= set(greens)
    assert len(served) + group_stats(http, "greens")["in_flight"] == 20


def test_a_changed_filter_is_409_and_the_same_one_in_any_order_is_not(
    http: httpx.Client,
) -> None:
    produce(http, 8)
    assert pull(http, "mixed", ["gold", "red"]).status_code == 200
    assert pull(http, "mixed", ["red", "gold"]).status_code == 200
    for other in (["red"], ["red", "gold", "blue"], None):
        answer = pull(http, "mixed", other)
        assert answer.status_code == 409, other
        assert answer.json()["error"]["code"] == "tags_conflict"
        assert answer.json()["error"]["field"] == "tags"
    # a group made without a filter cannot take one on later
    assert pull(http, "plain", None).status_code == 200
    assert pull(http, "plain", ["red"]).json()["error"]["code"] == "tags_conflict"


@pytest.mark.parametrize(
    ("tags", "field"),
    [
        (["has space"], "messages[0].tags[0]"),
        (["x" * 65], "messages[0].tags[0]"),
        ([""], "messages[0].tags[0]"),
        (["ok", "no,comma"], "messages[0].tags[1]"),
        (["same", "same"], "messages[0].tags"),
        ([f"t{i}" for i in range(9)], "messages[0].tags"),
        ("red", "messages[0].tags"),
        ([1], "messages[0].tags[0]"),
    ],
)
def test_bad_tags_on_produce_are_400_naming_the_field(
    http: httpx.Client, tags: Any, field: str
) -> None:
    message = {"id": "m", "subject": "orders", "body": "b", "tags": tags}
    answer = post(http, "/v1/messages", {"messages": [message]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_tags"
    assert answer.json()["error"]["field"] == field


@pytest.mark.parametrize(
    ("tags", "field"),
    [
        ([], "tags"),
        (["a", "a"], "tags"),
        (["bad/tag"], "tags[0]"),
        ([f"t{i}" for i in range(9)], "tags"),
    ],
)
def test_bad_tag_filters_on_pull_are_400_naming_the_field(
    http: httpx.Client, tags: Any, field: str
) -> None:
    answer = pull(http, "g", tags)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_tags"
    assert answer.json()["error"]["field"] == field


def test_delayed_and_ordered_messages_keep_their_tags(http: httpx.Client) -> None:
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    later = {"id": "d", "subject": "orders", "body": "b", "tags": ["late"], "deliver_at": soon}
    answer = post(http, "/v1/messages", {"messages": [later]})
    assert answer.json()["results"][0]["status"] == "scheduled"  # kept in the schedule log
    doc = {"subject": "orders", "group": "late", "consumer": "c", "tags": ["late"]}
    served = post(http, "/v1/pull", {**doc, "wait_ms": 10_000}).json()["messages"]
    assert [(m["id"], m["tags"]) for m in served] == [("d", ["late"])]

    assert http.put("/v1/subjects/ledger", json={"ordered": True}).status_code in (200, 201)
    keyed = {"id": "o", "subject": "ledger", "key": "k", "body": "b", "tags": ["x", "y"]}
    assert post(http, "/v1/messages", {"messages": [keyed]}).status_code == 200
    doc = {"subject": "ledger", "group": "g", "consumer": "c", "mode": "ordered"}
    served = post(http, "/v1/pull", doc).json()["messages"]
    assert [(m["id"], m["tags"]) for m in served] == [("o", ["x", "y"])]
    refused = post(http, "/v1/pull", {**doc, "tags": ["x"]})
    assert refused.status_code == 409
    assert refused.json()["error"] == {
        "code": "tags_not_ordered",
        "message": refused.json()["error"]["message"],
        "field": "tags",
    }


def test_an_unreadable_record_under_a_filter_goes_dead_once_and_is_passed(
    broker: BrokerProcess, http: httpx.Client
) -> None:
    messages = [
        {"id": f"m-{i}", "subject": "orders", "body": f"payload-{i}", "tags": ["red"]}
        for i in range(4)
    ]
    assert post(http, "/v1/messages", {"messages": messages}).status_code == 200
    assert broker.terminate() == 0
    segment = sorted((broker.data_dir / "messages").iterdir())[-1]
    data = bytearray(segment.read_bytes())
    data[data.find(b"payload-3")] ^= 0xFF  # the last one: nothing after it to lease
    segment.write_bytes(bytes(data))
    broker.start()

    served = pull(http, "reds", ["red"]).json()["messages"]
    assert [m["seq"] for m in served] == [0, 1, 2]
    for _ in range(3):  # looked at again and again: buried once, the cursor past it
        assert pull(http, "reds", ["red"]).json()["messages"] == []
    dead = http.get("/v1/subjects/orders/groups/reds/dead").json()["dead"]
    assert [(d["seq"], d["error"]) for d in dead] == [(3, "unreadable record")]
    stats = group_stats(http, "reds")
    assert (stats["dead"], stats["backlog"], stats["filtered"]) == (1, 0, 0)


def test_a_long_run_of_skipped_messages_is_crossed_in_turns(
    broker: BrokerProcess, http: httpx.Client
) -> None:
    """Past ``SCAN_LOOKS`` looks without a match a pull yields and goes on at once: 40,000
    skipped messages, then the one that matches, reached within one long poll."""
    for batch in range(40):
        messages = [
            {"id": f"m-{batch}-{i}", "subject": "orders", "body": "x", "tags": ["noise"]}
            for i in range(1000)
        ]
        assert post(http, "/v1/messages", {"messages": messages}).status_code == 200
    wanted = {"id": "signal", "subject": "orders", "body": "x", "tags": ["signal"]}
    assert post(http, "/v1/messages", {"messages": [wanted]}).status_code == 200

    doc = {"subject": "orders", "group": "g", "consumer": "c", "tags": ["signal"]}
    first = post(http, "/v1/pull", doc).json()["messages"]  # no wait: what one turn found
    assert first == []
    assert 0 < group_stats(http, "g")["filtered"] < 40_000
    served = post(http, "/v1/pull", {**doc, "wait_ms": 20_000}).json()["messages"]
    assert [m["id"] for m in served] == ["signal"]
    assert group_stats(http, "g")["filtered"] == 40_000


def test_kill_9_in_the_middle_of_filtered_consumption_loses_no_match_and_serves_no_other(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    """Five cycles of produce, a filtered consumer acking as it goes, kill -9: every red
    message is served and acked in the end, no other ever is, and the skips count once."""
    broker = broker_factory(tmp_path / "crashing", extra_args=["--ack-timeout", "1s"]).start()
    served: list[dict[str, Any]] = []
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        for cycle in range(5):
            produce(http, 80, first=cycle * 80)
            answer = pull(http, "reds", ["red"])
            served.extend(answer.json()["messages"])
            ack = [m["seq"] for m in answer.json()["messages"]]
            served.extend(pull(http, "reds", ["red"], ack=ack).json()["messages"])  # unacked
            broker.kill9()
            broker.start()
        deadline = time.monotonic() + 30
        while group_stats(http, "reds")["acked"] < 100 and time.monotonic() < deadline:
            rest, _ = drain(http, "reds", ["red"])  # what the crashes left, leases expired
            served.extend(rest)
            time.sleep(0.2)
        stats = group_stats(http, "reds")
    assert all("red" in m["tags"] for m in served)
    assert {m["id"] for m in served} == {f"m-{i}" for i in range(0, 400, 4)}
    assert (stats["acked"], stats["in_flight"], stats["retrying"], stats["dead"]) == (100, 0, 0, 0)
    assert stats["filtered"] == 300  # each skip counted once, crashes or not
