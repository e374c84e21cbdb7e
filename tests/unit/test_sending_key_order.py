"""The dispatcher's per-key order logic, without I/O: lanes, holds, the order check's use."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import pytest
import sqlalchemy as sa

from qmq_outbox.dispatcher import Dispatch, Keyed, KeyLanes
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import OutboxStoreError
from qmq_outbox.store import OrderCheck

ENGINE = sa.create_engine("sqlite://")


def msg(name: str, key: str | None = None, subject: str = "s") -> OutgoingMessage:
    return OutgoingMessage(id=name, subject=subject, body=b"{}", key=key)


def check(
    sendable: dict[str, int], held: Collection[str] = (), settled: Collection[str] = ()
) -> OrderCheck:
    return OrderCheck(sendable=sendable, held=frozenset(held), settled=frozenset(settled))


def dispatch(**options: object) -> Dispatch:
    settings: dict[str, object] = {"capacity": 100, "batch_size": 10, "cooldown": 1.0, "lanes": 3}
    settings.update(options)
    return Dispatch(**settings)  # type: ignore[arg-type]


def test_a_key_always_lands_in_the_same_lane_and_keys_spread() -> None:
    lanes = KeyLanes(4)
    assert {lanes.lane_of(msg(f"m{i}", key="k")) for i in range(20)} == {
        lanes.lane_of(msg("x", "k"))
    }
    assert len({lanes.lane_of(msg("m", key=f"k{i}")) for i in range(64)}) == 4
    assert lanes.lane_of(msg("m", "k", subject="a")) == KeyLanes(4).lane_of(msg("n", "k", "a"))


def test_a_held_message_keeps_its_keys_later_messages_back_but_not_other_keys() -> None:
    lanes = KeyLanes(1)
    lanes.add(ENGINE, [msg("a1", "a"), msg("b1", "b")])
    first = lanes.take(0, 10, now=100.0)
    assert [e.message.id for e in first] == ["a1", "b1"]
    first[0].holds, first[0].due = 1, 100.5
    lanes.put_back(0, [first[0]])
    lanes.add(ENGINE, [msg("a2", "a"), msg("b2", "b")])
    assert [e.message.id for e in lanes.take(0, 10, now=100.1)] == ["b2"]
    assert lanes.next_due(0, now=100.1) == 100.5
    assert [e.message.id for e in lanes.take(0, 10, now=100.6)] == ["a1", "a2"]
    assert lanes.is_empty(0)
    assert lanes.next_due(0, now=100.6) is None


def test_a_lane_sleeps_until_the_held_message_that_blocks_its_key_is_due() -> None:
    lanes = KeyLanes(1)
    lanes.add(ENGINE, [msg("a1", "a"), msg("a2", "a")])
    a1, a2 = lanes.take(0, 10, now=0.0)
    a1.holds, a1.due = 2, 0.04
    a2.holds, a2.due = 1, 0.02
    lanes.put_back(0, [a1, a2])
    assert lanes.take(0, 10, now=0.03) == []  # a2 is due, but behind a1
    assert lanes.next_due(0, now=0.03) == 0.04  # not a2's time, long past: no busy wait
    assert [e.message.id for e in lanes.take(0, 10, now=0.04)] == ["a1", "a2"]


def test_take_respects_the_limit_and_keeps_the_rest_in_order() -> None:
    lanes = KeyLanes(1)
    lanes.add(ENGINE, [msg(f"m{i}", key=f"k{i % 2}") for i in range(5)])
    assert [e.message.id for e in lanes.take(0, 2, now=0.0)] == ["m0", "m1"]
    assert [e.message.id for e in lanes.take(0, 10, now=0.0)] == ["m2", "m3", "m4"]


def test_offer_routes_keyed_messages_to_lanes_within_one_capacity() -> None:
    d = dispatch(capacity=4)
    assert d.offer(ENGINE, [msg("p1"), msg("k1", "k"), msg("k2", "k")])
    assert len(d.backlog) == 1
    assert len(d.keyed) == 2
    assert d.queued == 3
    assert not d.offer(ENGINE, [msg("p2"), msg("k3", "k")])  # all or nothing
    assert d.offer(ENGINE, [msg("k3", "k")])
    lane = d.keyed.lane_of(msg("k1", "k"))
    batch = d.take(lane)
    assert [m.id for _, m in batch.plain] == ["p1"]
    assert [e.message.id for e in batch.keyed] == ["k1", "k2", "k3"]
    assert d.drained(lane)


def test_keyed_and_unkeyed_share_a_batch_when_both_wait() -> None:
    d = dispatch(batch_size=10, lanes=1)
    assert d.offer(ENGINE, [msg(f"p{i}") for i in range(30)])
    assert d.offer(ENGINE, [msg(f"k{i}", "k") for i in range(30)])
    batch = d.take(0)
    assert (len(batch.plain), len(batch.keyed)) == (5, 5)
    only_keyed = dispatch(batch_size=10, lanes=1)
    assert only_keyed.offer(ENGINE, [msg(f"k{i}", "k") for i in range(30)])
    assert len(only_keyed.take(0).keyed) == 10


def test_other_lanes_do_not_take_a_keys_messages() -> None:
    d = dispatch(lanes=2)
    message = msg("k1", "k")
    assert d.offer(ENGINE, [message])
    mine = d.keyed.lane_of(message)
    assert not d.take(1 - mine)
    assert [e.message.id for e in d.take(mine).keyed] == ["k1"]


def entries(*messages: OutgoingMessage) -> list[Keyed]:
    return [Keyed(ENGINE, m) for m in messages]


def test_ordered_sends_in_outbox_id_order_and_holds_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="qmq_outbox.dispatcher")
    d = dispatch(lanes=1, hold_delay=0.5)
    keyed = entries(msg("a3", "a"), msg("a1", "a"), msg("b1", "b"), msg("a2", "a"), msg("x", "c"))
    answer = check({"a1": 1, "a2": 2, "b1": 5, "a3": 3}, held=set(), settled={"x"})
    assert [m.id for m in d.ordered(0, ENGINE, keyed, answer)] == ["a1", "a2", "a3", "b1"]
    assert d.keyed.is_empty(0)  # the settled one is dropped, not held
    held = entries(msg("c2", "c"), msg("c3", "c"))
    assert d.ordered(0, ENGINE, held, check({}, held={"c2", "c3"})) == []
    assert d.wait_time(0, now=0.0) is not None
    assert [e.holds for e in held] == [1, 1]
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions == ["outbox.order_held"]


def test_a_held_message_is_tried_again_later_then_left_to_the_compensator() -> None:
    d = dispatch(lanes=1, hold_delay=0.01, max_holds=3)
    held = entries(msg("a2", "a"))
    delays = []
    for _ in range(3):
        before = time.monotonic()
        assert d.ordered(0, ENGINE, held, check({}, held={"a2"})) == []
        delays.append(held[0].due - before)
        assert not d.keyed.take(0, 10, now=before)  # not due yet
        assert [e.message.id for e in d.keyed.take(0, 10, now=held[0].due)] == ["a2"]
    for holds, delay in enumerate(delays):  # 10, 20, 40 ms, plus the call itself
        assert 0.01 * 2**holds <= delay < 0.01 * 2**holds + 0.05
    assert d.ordered(0, ENGINE, held, check({}, held={"a2"})) == []
    assert d.keyed.is_empty(0)  # the compensator's now


def test_a_failed_check_sends_no_keyed_message_and_counts_as_a_database_failure() -> None:
    d = dispatch(lanes=1)
    keyed = entries(msg("a1", "a"))
    assert d.ordered(0, ENGINE, keyed, OutboxStoreError("outbox order check failed")) == []
    assert d.keyed.is_empty(0)
    assert next(iter(d.databases.values())).failing
