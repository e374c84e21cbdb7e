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
