"""Replay (docs/architecture.md 3.7) on the fake and the real broker alike: a group reset to
a seq, a time, earliest or latest; a first pull's start at a seq or a time; 409 while
messages are leased out unless forced; broadcast and ordered groups; refusals."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from qmq_outbox.envelope import Message, OutgoingMessage
from qmq_outbox.errors import BrokerRejected
from tests.contract.conftest import Target
from tests.contract.test_ordered import declare, keys_of, publish


def produce_apart(target: Target, subject: str, count: int, first: int = 0) -> None:
    """``count`` messages (ids from ``id-<first>``), one produce each, with time passing in
    between: each has a stored time of its own."""
    for i in range(first, first + count):
        message = OutgoingMessage(id=f"id-{i}", subject=subject, body=f"body-{i}".encode())
        assert target.client.produce([message])[0].status == "stored"
        target.advance(0.005)


def drain(target: Target, subject: str, group: str, consumer: str = "c1") -> list[Message]:
    """Everything the group is served now, acked."""
    out: list[Message] = []
    while batch := target.client.pull(subject, group, consumer, max_messages=50):
        out.extend(batch)
        target.client.ack(subject, group, consumer, [m.seq for m in batch])
    return out


def seqs(messages: list[Message]) -> list[tuple[int, int]]:
    return [(m.seq, m.attempt) for m in messages]


def error(response: httpx.Response) -> tuple[int, str, str | None]:
    body = response.json()["error"]
    return response.status_code, body["code"], body["field"]


def reset(target: Target, subject: str, group: str, doc: Any) -> httpx.Response:
    return target.post(f"/v1/subjects/{subject}/groups/{group}/reset", doc)


def test_reset_to_a_seq_a_time_earliest_and_latest(target: Target) -> None:
    subject = target.subject()
    produce_apart(target, subject, 5)
    first = drain(target, subject, "billing")
    assert seqs(first) == [(s, 1) for s in range(5)]

    answer = target.client.reset_group(subject, "billing", {"seq": 2})
    assert answer == {
        "positions": [{"partition": None, "consumer": None, "seq": 2}],
        "dropped_leases": 0,
    }
    assert seqs(drain(target, subject, "billing")) == [(2, 1), (3, 1), (4, 1)]

    stored_at = first[3].stored_at
    assert stored_at is not None
    answer = target.client.reset_group(subject, "billing", {"time": stored_at.isoformat()})
    assert answer["positions"][0]["seq"] == 3
    assert [m.id for m in drain(target, subject, "billing")] == ["id-3", "id-4"]

    target.client.reset_group(subject, "billing", "earliest")
    assert [m.id for m in drain(target, subject, "billing")] == [f"id-{i}" for i in range(5)]

    answer = target.client.reset_group(subject, "billing", "latest")
    assert answer["positions"][0]["seq"] == 5
    assert drain(target, subject, "billing") == []
    produce_apart(target, subject, 1, first=5)
    assert [m.id for m in drain(target, subject, "billing")] == ["id-5"]


def test_positions_outside_the_log_clamp_to_its_ends(target: Target) -> None:
    subject = target.subject()
    produce_apart(target, subject, 3)
    drain(target, subject, "billing")
    assert target.client.reset_group(subject, "billing", {"seq": 99})["positions"][0]["seq"] == 3
    before = {"time": "2000-01-01T00:00:00Z"}
    assert target.client.reset_group(subject, "billing", before)["positions"][0]["seq"] == 0
    after = {"time": "2999-01-01T00:00:00+01:00"}
    assert target.client.reset_group(subject, "billing", after)["positions"][0]["seq"] == 3


def test_a_reset_is_refused_while_messages_are_leased_out_unless_forced(target: Target) -> None:
    subject = target.subject()
    produce_apart(target, subject, 3)
    leased = target.client.pull(subject, "billing", "c1", max_messages=2)
    assert seqs(leased) == [(0, 1), (1, 1)]
    status, code, field = error(reset(target, subject, "billing", {"to": "earliest"}))
    assert (status, code, field) == (409, "group_busy", "force")
    with pytest.raises(BrokerRejected) as refused:
        target.client.reset_group(subject, "billing", "earliest")
    assert (refused.value.status, refused.value.code) == (409, "group_busy")

    answer = target.client.reset_group(subject, "billing", "earliest", force=True)
    assert answer["dropped_leases"] == 2
    # the dropped leases' acks are stale: unknown, and nothing changes
    assert target.client.ack(subject, "billing", "c1", [0, 1]) == {"acked": 0, "unknown": [0, 1]}
    assert target.client.nack(subject, "billing", "c1", [0]) == {"retrying": 0, "dead": 0}
    assert seqs(drain(target, subject, "billing")) == [(0, 1), (1, 1), (2, 1)]


def test_retries_and_dead_letters_at_or_after_the_position_go_the_others_stay(
    target: Target,
) -> None:
    subject = target.subject()
    produce_apart(target, subject, 4)
    batch = target.client.pull(subject, "billing", "c1", max_messages=4)
    assert seqs(batch) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    target.client.nack(subject, "billing", "c1", [0], delay_ms=3_600_000)  # retry in an hour
    target.client.ack(subject, "billing", "c1", [1, 3])
    target.client.nack(subject, "billing", "c1", [2], delay_ms=0)
    again = target.client.pull(subject, "billing", "c1", max_messages=4)
    assert seqs(again) == [(2, 2)]
    assert target.client.nack(subject, "billing", "c1", [2]) == {"retrying": 0, "dead": 1}
    group = target.client.subject(subject)["groups"][0]
    assert (group["retrying"], group["dead"]) == (1, 1)

    target.client.reset_group(subject, "billing", {"seq": 1})
    group = target.client.subject(subject)["groups"][0]
    assert (group["retrying"], group["dead"], group["in_flight"]) == (1, 0, 0)
    assert seqs(drain(target, subject, "billing")) == [(1, 1), (2, 1), (3, 1)]
    assert target.client.dead_letters(subject, "billing")["dead"] == []


def test_a_first_pull_starts_at_a_seq_or_a_time(target: Target) -> None:
    subject = target.subject()
    produce_apart(target, subject, 4)
    everything = target.client.pull(subject, "audit", "c1", max_messages=10)
    assert seqs(target.client.pull(subject, "from-seq", "c1", start={"seq": 2})) == [
        (2, 1),
        (3, 1),
    ]
    stored_at = everything[1].stored_at
    assert stored_at is not None
    by_time = target.client.pull(subject, "from-time", "c1", start={"time": stored_at.isoformat()})
    assert [m.id for m in by_time] == ["id-1", "id-2", "id-3"]
    # the start counts only for a group's first pull
    assert target.client.pull(subject, "from-seq", "c1", start={"seq": 0}) == []
    # a broadcast consumer new to its group starts where its own pull says
    one = target.client.pull(subject, "fan", "c1", mode="broadcast", start={"seq": 3})
    two = target.client.pull(subject, "fan", "c2", mode="broadcast", start="earliest")
    assert (seqs(one), len(two)) == ([(3, 1)], 4)


def test_a_broadcast_group_resets_every_consumer(target: Target) -> None:
    subject = target.subject()
    produce_apart(target, subject, 3)
    for consumer in ("c1", "c2"):
        pulled = target.client.pull(subject, "fan", consumer, mode="broadcast", max_messages=5)
        target.client.ack(subject, "fan", consumer, [m.seq for m in pulled])
    answer = target.client.reset_group(subject, "fan", {"seq": 1})
    assert answer["positions"] == [
        {"partition": None, "consumer": "c1", "seq": 1},
        {"partition": None, "consumer": "c2", "seq": 1},
    ]
    for consumer in ("c1", "c2"):
        again = target.client.pull(subject, "fan", consumer, mode="broadcast", max_messages=5)
        assert seqs(again) == [(1, 1), (2, 1)]


def test_an_ordered_group_resets_each_partition_by_time_or_one_by_seq(target: Target) -> None:
    subject = declare(target, 2)
    (low,), (high,) = keys_of(2)
    for n in range(3):
        publish(target, subject, [(low, n), (high, n)])
        target.advance(0.005)
    served: list[Any] = []
    while batch := target.client.pull(subject, "g", "c1", max_messages=10, mode="ordered"):
        served.extend(batch)
        for partition in (0, 1):
            mine = [m.seq for m in batch if m.partition == partition]
            if mine:
                target.client.ack(subject, "g", "c1", mine, partition=partition)
    assert len(served) == 6
    moment = next(m for m in served if m.partition == 0 and m.seq == 1).stored_at
    assert moment is not None
    answer = target.client.reset_group(subject, "g", {"time": moment.isoformat()})
    assert answer["positions"] == [
        {"partition": 0, "consumer": None, "seq": 1},
        {"partition": 1, "consumer": None, "seq": 1},
    ]
    again = target.client.pull(subject, "g", "c1", max_messages=10, mode="ordered")
    assert sorted((m.partition, m.seq) for m in again) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for partition in (0, 1):
        mine = [m.seq for m in again if m.partition == partition]
        target.client.ack(subject, "g", "c1", mine, partition=partition)

    status, code, field = error(reset(target, subject, "g", {"to": {"seq": 0}}))
    assert (status, code, field) == (409, "partition_required", "partition")
    answer = target.client.reset_group(subject, "g", {"seq": 2}, partition=1)
    assert answer["positions"] == [{"partition": 1, "consumer": None, "seq": 2}]
    last = target.client.pull(subject, "g", "c1", max_messages=10, mode="ordered")
    assert [(m.partition, m.seq, m.json()["key"]) for m in last] == [(1, 2, high)]
    start = {"seq": 1}
    with pytest.raises(BrokerRejected) as refused:
        target.client.pull(subject, "new", "c1", mode="ordered", start=start)
    assert (refused.value.code, refused.value.field) == ("partition_required", "start")
    status, code, field = error(reset(target, subject, "g", {"to": "earliest", "partition": 9}))
    assert (status, code, field) == (404, "partition_not_found", "partition")


@pytest.mark.parametrize(
    ("doc", "code", "field"),
    [
        ({}, "missing_field", "to"),
        ({"to": "yesterday"}, "invalid_to", "to"),
        ({"to": {"seq": -1}}, "invalid_to", "to"),
        ({"to": {"seq": 1, "time": "2026-01-01T00:00:00Z"}}, "invalid_to", "to"),
        ({"to": {"time": "2026-01-01 00:00"}}, "invalid_to", "to"),
        ({"to": {"offset": 3}}, "invalid_to", "to"),
        ({"to": "earliest", "force": "yes"}, "invalid_force", "force"),
        ({"to": "earliest", "extra": 1}, "unknown_field", "extra"),
    ],
)
def test_malformed_resets_name_the_field(
    target: Target, doc: dict[str, Any], code: str, field: str
) -> None:
    subject = target.subject()
    produce_apart(target, subject, 1)
    drain(target, subject, "billing")
    assert error(reset(target, subject, "billing", doc)) == (400, code, field)


def test_unknown_subjects_groups_and_partitions_of_plain_subjects(target: Target) -> None:
    subject = target.subject()
    produce_apart(target, subject, 1)
    drain(target, subject, "billing")
    earliest = {"to": "earliest"}
    assert error(reset(target, "nowhere", "billing", earliest)) == (
        404,
        "subject_not_found",
        "subject",
    )
    assert error(reset(target, subject, "nobody", earliest)) == (404, "group_not_found", "group")
    assert error(reset(target, subject, "billing", {**earliest, "partition": 0})) == (
        409,
        "not_ordered",
        "partition",
    )
    bad_start = {"subject": subject, "group": "g2", "consumer": "c1", "start": {"seq": "1"}}
    response = target.post("/v1/pull", bad_start)
    assert error(response) == (400, "invalid_start", "start")
    assert orjson.loads(response.content)["error"]["message"]
