"""Tags and tag filters, the same on the in-memory broker and the real one."""

from __future__ import annotations

from typing import Any

import pytest

from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerRejected
from tests.contract.conftest import Target

COLOURS = ("red", "green", "blue", "gold")


def produce(target: Target, subject: str, count: int) -> None:
    """Message i tagged ``COLOURS[i % 4]``; every third one ``vip`` too."""
    messages = [
        OutgoingMessage(
            id=f"id-{i}",
            subject=subject,
            body=f"body-{i}".encode(),
            tags=(COLOURS[i % 4], *(("vip",) if i % 3 == 0 else ())),
        )
        for i in range(count)
    ]
    assert {r.status for r in target.client.produce(messages)} == {"stored"}


def test_a_filtered_group_is_served_its_matches_only_and_counts_the_rest(
    target: Target,
) -> None:
    subject = target.subject()
    produce(target, subject, 12)
    first = target.client.pull(subject, "g", "c1", max_messages=2, tags=["red", "vip"])
    assert [(m.id, m.seq, m.tags) for m in first] == [
        ("id-0", 0, ("red", "vip")),
        ("id-3", 3, ("gold", "vip")),
    ]
    rest = target.client.ack_and_pull(
        subject, "g", "c1", [m.seq for m in first], max_messages=10, tags=["vip", "red"]
    )
    assert [m.id for m in rest.messages] == ["id-4", "id-6", "id-8", "id-9"]
    target.client.ack(subject, "g", "c1", [m.seq for m in rest.messages])
    (stats,) = target.client.subject(subject)["groups"]
    assert stats == {
        "group": "g",
        "mode": "shared",
        "backlog": 0,
        "in_flight": 0,
        "retrying": 0,
        "dead": 0,
        "acked": 6,
        "filtered": 6,
        "tags": ["red", "vip"],
    }
    # the same messages, whole, to a group without a filter
    everything = target.client.pull(subject, "all", "c1", max_messages=20)
    assert len(everything) == 12
    assert everything[1].tags == ("green",)


def test_a_broadcast_group_filters_for_each_consumer(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 8)
    for consumer in ("a", "b"):
        got = target.client.pull(subject, "fan", consumer, mode="broadcast", tags=["blue"])
        assert [m.id for m in got] == ["id-2", "id-6"]
    assert target.client.subject(subject)["groups"][0]["filtered"] == 12


def test_retries_come_first_and_the_filter_stays(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 12)  # reds: 0, 4, 8
    first = target.client.pull(subject, "g", "c1", max_messages=2, tags=["red"])
    assert [(m.id, m.attempt) for m in first] == [("id-0", 1), ("id-4", 1)]
    target.client.nack(subject, "g", "c1", [m.seq for m in first], delay_ms=0)
    # the retries fill the pull: the next match waits for the one after
    again = target.client.pull(subject, "g", "c1", max_messages=2, tags=["red"])
    assert [(m.id, m.attempt) for m in again] == [("id-0", 2), ("id-4", 2)]
    last = target.client.pull(subject, "g", "c1", max_messages=2, tags=["red"])
    assert [(m.id, m.attempt) for m in last] == [("id-8", 1)]
    (stats,) = target.client.subject(subject)["groups"]
    assert (stats["filtered"], stats["in_flight"], stats["backlog"]) == (9, 3, 0)


def test_a_changed_filter_is_409_naming_tags(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 2)
    target.client.pull(subject, "g", "c1", tags=["red"])
    for other in (["green"], None, ["red", "green"]):
        with pytest.raises(BrokerRejected) as refused:
            target.client.pull(subject, "g", "c1", tags=other)
        assert (refused.value.status, refused.value.code, refused.value.field) == (
            409,
            "tags_conflict",
            "tags",
        )
    target.client.pull(subject, "plain", "c1")
    with pytest.raises(BrokerRejected) as refused:
        target.client.pull(subject, "plain", "c1", tags=["red"])
    assert refused.value.code == "tags_conflict"


def test_a_reset_frees_the_filter_for_the_next_pull_to_fix(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 8)
    reds = target.client.pull(subject, "g", "c1", max_messages=10, tags=["red"])
    target.client.ack(subject, "g", "c1", [m.seq for m in reds])
    target.client.reset_group(subject, "g", "earliest")
    blues = target.client.pull(subject, "g", "c1", max_messages=10, tags=["blue"])
    assert [m.id for m in blues] == ["id-2", "id-6"]
    with pytest.raises(BrokerRejected) as refused:  # fixed again by that pull
        target.client.pull(subject, "g", "c1", tags=["red"])
    assert refused.value.code == "tags_conflict"


@pytest.mark.parametrize(
    ("tags", "field"),
    [
        (["a b"], "messages[0].tags[0]"),
        (["a" * 65], "messages[0].tags[0]"),
        (["a", "a"], "messages[0].tags"),
        ([str(i) for i in range(9)], "messages[0].tags"),
        ("a", "messages[0].tags"),
    ],
)
def test_bad_tags_are_400_naming_the_field(target: Target, tags: Any, field: str) -> None:
    message = {"id": "x", "subject": target.subject(), "body": "b", "tags": tags}
    answer = target.post("/v1/messages", {"messages": [message]})
    assert answer.status_code == 400
    assert (answer.json()["error"]["code"], answer.json()["error"]["field"]) == (
        "invalid_tags",
        field,
    )


@pytest.mark.parametrize(
    ("tags", "field"), [([], "tags"), (["x", "x"], "tags"), (["é"], "tags[0]")]
)
def test_bad_tag_filters_are_400_naming_the_field(target: Target, tags: Any, field: str) -> None:
    doc = {"subject": target.subject(), "group": "g", "consumer": "c", "tags": tags}
    answer = target.post("/v1/pull", doc)
    assert answer.status_code == 400
    assert (answer.json()["error"]["code"], answer.json()["error"]["field"]) == (
        "invalid_tags",
        field,
    )


def test_an_ordered_subject_keeps_tags_and_refuses_a_filter(target: Target) -> None:
    subject = target.subject()
    target.client.declare_subject(subject, partitions=1)
    message = OutgoingMessage(id="o", subject=subject, key="k", body=b"b", tags=("t",))
    target.client.produce([message])
    (got,) = target.client.pull(subject, "g", "c1", mode="ordered")
    assert got.tags == ("t",)
    with pytest.raises(BrokerRejected) as refused:
        target.client.pull(subject, "g", "c1", mode="ordered", tags=["t"])
    assert (refused.value.status, refused.value.code, refused.value.field) == (
        409,
        "tags_not_ordered",
        "tags",
    )
