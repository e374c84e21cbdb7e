"""Delivery state: leases, retries, dead letters, and replay equivalence."""

from __future__ import annotations

from typing import Any

from qmq_broker.format import ActionRecord, ActionType
from qmq_broker.groups import DeliveryState, Policy

POLICY = Policy(ack_timeout_us=30_000_000, max_attempts=3, backoff_s=(1, 5, 10))


def rec(kind: ActionType, seqs: list[int], at: int = 0, **fields: Any) -> ActionRecord:
    return ActionRecord(
        type=kind, at_us=at, subject="s", group="g", seqs=tuple(seqs), fields=fields
    )


def lease(
    state: DeliveryState, *, now: int, limit: int, end: int, consumer: str = "c"
) -> list[int]:
    seqs, attempts = state.choose(limit=limit, now_us=now, end_seq=end)
    if seqs:
        state.apply(
            rec(
                ActionType.LEASE,
                seqs,
                now,
                consumer=consumer,
                deadline=now + POLICY.ack_timeout_us,
                attempts=attempts,
            )
        )
    return seqs


def test_new_messages_are_leased_in_order_and_acked() -> None:
    state = DeliveryState(0)
    assert lease(state, now=0, limit=2, end=5) == [0, 1]
    assert lease(state, now=0, limit=10, end=5) == [2, 3, 4]
    state.apply(rec(ActionType.ACK, [0, 1, 2]))
    assert state.acked == 3
    assert sorted(state.leases) == [3, 4]


def test_due_retries_come_before_new_messages() -> None:
    state = DeliveryState(0)
    lease(state, now=0, limit=2, end=10)
    assert state.nack_outcomes([1], consumer="other", now_us=0, delay_us=None, policy=POLICY) == (
        {},
        [],
    )  # only the lease holder may nack
    retry, dead = state.nack_outcomes([1], consumer="c", now_us=0, delay_us=None, policy=POLICY)
    assert dead == []
    assert retry == {1_000_000: [1]}
    state.apply(rec(ActionType.RETRY, [1], due=1_000_000))
    assert lease(state, now=500_000, limit=1, end=10) == [2]  # not due yet
    assert lease(state, now=1_000_000, limit=2, end=10) == [1, 3]
    assert state.leases[1].attempt == 2


def test_expired_lease_is_a_failed_attempt_then_dead() -> None:
    state = DeliveryState(0)
    now = 0
    for attempt in range(1, 4):
        assert lease(state, now=now, limit=1, end=1) == [0]
        assert state.leases[0].attempt == attempt
        now += POLICY.ack_timeout_us
        for kind, seqs, fields in state.expire(now_us=now, policy=POLICY):
            state.apply(rec(kind, seqs, now, **fields))
    assert 0 in state.dead
    assert state.dead[0].attempts == 3
    assert lease(state, now=now, limit=1, end=1) == []


def test_redrive_puts_dead_letters_back_with_fresh_attempts() -> None:
    state = DeliveryState(0)
    lease(state, now=0, limit=1, end=1)
    state.apply(rec(ActionType.DEAD, [0], 5, error="boom"))
    assert state.dead[0].error == "boom"
    state.apply(rec(ActionType.REDRIVE, [0], 10))
    assert lease(state, now=10, limit=1, end=1) == [0]
    assert state.leases[0].attempt == 1


def test_snapshot_restore_equals_live_state() -> None:
    state = DeliveryState(0)
    lease(state, now=0, limit=5, end=8)
    state.apply(rec(ActionType.ACK, [0]))
    state.apply(rec(ActionType.RETRY, [1], due=7))
    state.apply(rec(ActionType.DEAD, [2], error="x"))
    restored = DeliveryState.restore(state.snapshot())
    assert restored.snapshot() == state.snapshot()
    assert lease(restored, now=7, limit=10, end=8) == lease(state, now=7, limit=10, end=8)


def test_a_reset_moves_the_cursor_drops_leases_and_what_failed_at_or_after_it() -> None:
    state = DeliveryState(0)
    assert lease(state, now=0, limit=6, end=6) == [0, 1, 2, 3, 4, 5]
    state.apply(rec(ActionType.RETRY, [1, 4], due=9_000_000))
    state.apply(rec(ActionType.DEAD, [0, 3], error="boom"))
    state.apply(rec(ActionType.RESET, [], 5, cursor=2))
    assert (state.cursor, state.leases) == (2, {})
    assert sorted(state.retries) == [1]  # before the position: kept with its due time
    assert sorted(state.dead) == [0]
    assert state.holds(5, "c") is False  # a late ack of a dropped lease is unknown
    assert lease(state, now=0, limit=10, end=6) == [2, 3, 4, 5]
    assert [state.leases[s].attempt for s in (2, 3, 4, 5)] == [1, 1, 1, 1]
    assert lease(state, now=9_000_000, limit=10, end=6) == [1]


def test_a_reset_survives_a_snapshot_and_replays_the_same() -> None:
    records = [
        rec(ActionType.LEASE, [0, 1, 2], 0, consumer="c", deadline=30, attempts=[1, 1, 1]),
        rec(ActionType.RETRY, [0], due=7),
        rec(ActionType.DEAD, [2], error="x"),
        rec(ActionType.RESET, [], 9, cursor=1),
    ]
    replayed = DeliveryState(0)
    for record in records:
        replayed.apply(record)
    restored = DeliveryState.restore(replayed.snapshot())
    assert restored.snapshot() == replayed.snapshot()
    assert replayed.snapshot() == {
        "cursor": 1,
        "acked": 0,
        "filtered": 0,
        "leases": [],
        "retries": [[0, 1, 7, None]],
        "dead": [],
    }
    encoded = records[-1].encode()
    assert ActionRecord.decode(encoded) == records[-1]
    assert encoded[0] == 7  # a record type old data never holds: no format version bump


def test_a_reset_drops_the_passed_over_seqs_it_will_read_again() -> None:
    records = [  # a keyed lease of 0 and 3 passes over 1 and 2
        rec(ActionType.LEASE, [0, 3], 0, consumer="c", deadline=30, attempts=[1, 1]),
        rec(ActionType.RESET, [], 9, cursor=2),
    ]
    state = DeliveryState(0)
    state.apply(records[0])
    assert state.skipped == {1, 2}
    state.apply(records[1])
    assert (state.cursor, state.skipped, state.leases) == (2, {1}, {})
