"""Per-key concurrency inside an ordered partition (docs/architecture.md 3.6), on the fake and
the real broker alike: keys of one partition are in flight side by side, a retry or a dead
letter holds back its own key only, ``max_keys`` bounds the keys in flight, and a route
change waits for every message of the closed partition, whatever the key order.
"""

from __future__ import annotations

from typing import Any

import pytest

from qmq_outbox.errors import BrokerRejected
from tests.contract.conftest import MAX_ATTEMPTS, Target
from tests.contract.test_ordered import declare, error, publish

RETRY_MS = 2_000  # a retry's delay: long enough to see it not due, short to wait out
WAIT_OUT_S = RETRY_MS / 1000 + 0.2


class Partition:
    """Partition 0 of a fresh one-partition subject, consumed by c1 of group g; messages
    named (key, n) as ``publish`` makes them."""

    def __init__(self, target: Target, **declared: Any) -> None:
        self.target = target
        self.subject = declare(target, 1, **declared)
        self.seqs: dict[tuple[str, int], int] = {}

    def publish(self, *messages: tuple[str, int]) -> None:
        publish(self.target, self.subject, list(messages))

    def pull(self, **options: Any) -> list[tuple[str, int, int]]:
        """(key, n, attempt) of what an ordered pull served, in order."""
        options = {"max_messages": 50, "mode": "ordered"} | options
        messages = self.target.client.pull(self.subject, "g", "c1", **options)
        served = []
        for message in messages:
            body = message.json()
            self.seqs[(body["key"], body["n"])] = message.seq
            served.append((body["key"], body["n"], message.attempt))
        return served

    def ack(self, *messages: tuple[str, int]) -> None:
        seqs = [self.seqs[m] for m in messages]
        answer = self.target.client.ack(self.subject, "g", "c1", seqs, partition=0)
        assert answer == {"acked": len(seqs), "unknown": []}

    def nack(self, *messages: tuple[str, int], delay_ms: int) -> None:
        seqs = [self.seqs[m] for m in messages]
        self.target.client.nack(
            self.subject, "g", "c1", seqs, delay_ms=delay_ms, error="boom", partition=0
        )


def test_keys_of_one_partition_run_side_by_side_and_a_retry_holds_back_its_own_only(
    target: Target,
) -> None:
    part = Partition(target)
    part.publish(("a", 0), ("b", 0), ("a", 1), ("c", 0))
    # every key at once; a key's consecutive messages come together, in seq order
    assert part.pull() == [("a", 0, 1), ("b", 0, 1), ("a", 1, 1), ("c", 0, 1)]
    part.nack(("a", 0), ("a", 1), delay_ms=RETRY_MS)
    part.ack(("b", 0), ("c", 0))
    part.publish(("a", 2), ("b", 1), ("c", 1), ("b", 2))
    assert part.pull() == [("b", 1, 1), ("c", 1, 1), ("b", 2, 1)]  # a waits
    assert part.pull() == []
    part.ack(("b", 1), ("c", 1), ("b", 2))
    stats = target.client.subject(part.subject)["groups"][0]
    assert (stats["backlog"], stats["in_flight"], stats["retrying"]) == (1, 0, 2)  # a2 waits
    target.advance(WAIT_OUT_S)
    assert part.pull() == [("a", 0, 2), ("a", 1, 1), ("a", 2, 1)]  # a1 never ran


def test_a_keys_messages_behind_a_failure_never_die_with_it(target: Target) -> None:
    """Nacked together, the first of each key counts an attempt, the others are released:
    a dead first letter (``on_dead: skip``) lets the next one go at its first attempt."""
    part = Partition(target)
    part.publish(("a", 0), ("a", 1), ("b", 0), ("b", 1))
    for attempt in range(1, MAX_ATTEMPTS + 1):
        served = part.pull()
        assert served == [("a", 0, attempt), ("a", 1, 1), ("b", 0, attempt), ("b", 1, 1)]
        answer = target.client.nack(
            part.subject, "g", "c1", sorted(part.seqs.values()), delay_ms=0, partition=0
        )
        dead = 2 if attempt == MAX_ATTEMPTS else 0
        assert answer == {"retrying": 4 - dead, "dead": dead}
    assert part.pull() == [("a", 1, 1), ("b", 1, 1)]


def test_max_keys_bounds_the_keys_in_flight_per_partition(target: Target) -> None:
    part = Partition(target)
    part.publish(("a", 0), ("b", 0), ("c", 0), ("a", 1), ("d", 0))
    assert part.pull(max_keys=2) == [("a", 0, 1), ("b", 0, 1), ("a", 1, 1)]
    assert part.pull(max_keys=2) == []
    part.ack(("b", 0))
    assert part.pull(max_keys=2) == [("c", 0, 1)]
    part.ack(("a", 0), ("a", 1), ("c", 0))
    assert part.pull(max_keys=2) == [("d", 0, 1)]


def test_a_dead_letter_blocks_its_key_only_until_redriven(target: Target) -> None:
    part = Partition(target, on_dead="block")
    part.publish(("a", 0), ("b", 0), ("a", 1), ("b", 1))
    for attempt in range(1, MAX_ATTEMPTS + 1):
        assert part.pull(max_messages=1) == [("a", 0, attempt)]
        part.nack(("a", 0), delay_ms=0)
    assert part.pull() == [("b", 0, 1), ("b", 1, 1)]  # a is dead: b goes on
    part.ack(("b", 0), ("b", 1))
    assert part.pull() == []  # a1 waits behind its key's dead letter
    assert target.client.redrive(part.subject, "g", partition=0) == 1
    assert part.pull() == [("a", 0, 1), ("a", 1, 1)]


def test_a_split_waits_for_every_message_of_the_closed_partition_whatever_the_key(
    target: Target,
) -> None:
    part = Partition(target)
    part.publish(("a", 0), ("b", 0), ("a", 1), ("b", 1))
    assert part.pull(max_messages=1) == [("a", 0, 1)]
    part.nack(("a", 0), delay_ms=RETRY_MS)
    assert part.pull() == [("b", 0, 1), ("b", 1, 1)]
    part.ack(("b", 0), ("b", 1))
    assert target.client.split_partition(part.subject, partition=0, at=512)["version"] == 2
    part.publish(("a", 2), ("b", 2))
    # a0 retrying and a1 behind it: the new partitions wait, b's included
    assert part.pull() == []
    assert target.client.routes(part.subject)["groups"] == [{"group": "g", "version": 1}]
    target.advance(WAIT_OUT_S)
    assert part.pull() == [("a", 0, 2), ("a", 1, 1)]
    part.ack(("a", 0), ("a", 1))
    assert sorted(part.pull()) == [("a", 2, 1), ("b", 2, 1)]
    assert target.client.routes(part.subject)["groups"] == [{"group": "g", "version": 2}]


@pytest.mark.parametrize("bad", [0, 1025, "4", None])
def test_a_bad_max_keys_is_refused_naming_the_field(target: Target, bad: Any) -> None:
    subject = declare(target, 1)
    body = {"subject": subject, "group": "g", "consumer": "c1", "mode": "ordered"}
    response = target.post("/v1/pull", body | {"max_keys": bad})
    assert error(response) == (400, "invalid_max_keys", "max_keys")
    with pytest.raises(BrokerRejected) as refused:
        target.client.pull(subject, "g", "c1", mode="ordered", max_keys=0)
    assert (refused.value.status, refused.value.field) == (400, "max_keys")
