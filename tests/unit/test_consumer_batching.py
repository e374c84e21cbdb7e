"""Pure bookkeeping of the consumer: ack batching and the lease budget (bounded prefetch)."""

from __future__ import annotations

import asyncio

import pytest

from qmq_outbox.consumer.acks import AckBuffer, chunks
from qmq_outbox.consumer.budget import LeaseBudget, grant, next_want
from qmq_outbox.consumer.logs import backoff


def test_ack_buffer_is_due_by_size() -> None:
    buffer = AckBuffer(max_size=3, interval=10.0)
    assert buffer.due_in(0.0) is None
    assert not buffer.add("a", 1, now=0.0)
    assert not buffer.add("b", 7, now=0.0)
    assert buffer.add("a", 2, now=0.0)
    assert buffer.due_in(0.0) == 0.0
    assert buffer.take() == {"a": [1, 2], "b": [7]}
    assert len(buffer) == 0
    assert buffer.due_in(0.0) is None


def test_ack_buffer_is_due_by_the_oldest_acks_age() -> None:
    buffer = AckBuffer(max_size=100, interval=0.05)
    buffer.add("a", 1, now=10.0)
    buffer.add("a", 2, now=10.04)
    assert buffer.due_in(10.0) == pytest.approx(0.05)
    assert buffer.due_in(10.04) == pytest.approx(0.01)
    assert buffer.due_in(10.2) == 0.0


def test_ack_buffer_takes_back_what_could_not_be_sent() -> None:
    buffer = AckBuffer(max_size=100, interval=1.0)
    buffer.add("a", 1, now=0.0)
    batch = buffer.take()
    buffer.add("a", 5, now=2.0)
    buffer.put_back(batch, now=2.0)
    assert sorted(buffer.take()["a"]) == [1, 5]


def test_ack_buffer_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_size"):
        AckBuffer(max_size=0, interval=1.0)


def test_chunks_split_large_acks() -> None:
    assert [len(c) for c in chunks(list(range(2500)))] == [1000, 1000, 500]


def test_grant_never_exceeds_capacity() -> None:
    assert grant(32, capacity=16, used=0) == 16
    assert grant(32, capacity=16, used=10) == 6
    assert grant(4, capacity=16, used=10) == 4
    assert grant(4, capacity=16, used=16) == 0
    assert grant(4, capacity=16, used=20) == 0


def test_an_idle_subject_asks_for_one_message() -> None:
    assert next_want(last_pulled=0, max_batch=32) == 1
    assert next_want(last_pulled=3, max_batch=32) == 32


def test_backoff_grows_and_caps() -> None:
    assert [backoff(n) for n in (1, 2, 3)] == [0.1, 0.2, 0.4]
    assert backoff(50) == 5.0


async def test_lease_budget_waits_until_a_slot_is_released() -> None:
    budget = LeaseBudget(2)
    assert await budget.acquire(5) == 2
    waiter = asyncio.create_task(budget.acquire(5))
    await asyncio.sleep(0.05)
    assert not waiter.done(), "acquire must wait while the budget is spent"
    budget.release(1)
    assert await asyncio.wait_for(waiter, 2) == 1
    assert budget.used == 2


async def test_lease_budget_grants_what_is_free() -> None:
    budget = LeaseBudget(3)
    assert await budget.acquire(2) == 2
    assert await budget.acquire(5) == 1
    pending = asyncio.create_task(budget.acquire(5))
    await asyncio.sleep(0)
    assert not pending.done()
    budget.release(2)
    assert await pending == 2


async def test_a_starved_acquire_calls_on_starved_once_before_waiting() -> None:
    budget = LeaseBudget(1)
    starved: list[int] = []
    assert await budget.acquire(1, lambda: starved.append(1)) == 1
    assert starved == []
    waiter = asyncio.create_task(budget.acquire(1, lambda: starved.append(1)))
    await asyncio.sleep(0)
    assert starved == [1]
    budget.release(1)
    assert await waiter == 1


async def test_closing_the_budget_wakes_waiters_with_nothing() -> None:
    budget = LeaseBudget(1)
    await budget.acquire(1)
    waiter = asyncio.create_task(budget.acquire(1))
    await asyncio.sleep(0)
    budget.close()
    assert await asyncio.wait_for(waiter, 2) == 0
    assert await budget.acquire(1) == 0


def test_budget_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LeaseBudget(0)


def test_a_hurried_buffer_is_due_at_once_until_taken() -> None:
    buffer = AckBuffer(max_size=100, interval=60.0)
    buffer.hurry()
    assert buffer.due_in(0.0) is None  # nothing to send yet
    buffer.add("a", 1, now=0.0)
    assert buffer.due_in(0.0) == 0.0
    buffer.take()
    buffer.add("a", 2, now=0.0)
    assert buffer.due_in(0.0) == 60.0


def test_a_pull_takes_one_subjects_acks_oldest_first() -> None:
    buffer = AckBuffer(max_size=100, interval=10.0)
    for seq in range(5):
        buffer.add("a", seq, now=1.0)
    buffer.add("b", 9, now=1.0)
    assert buffer.take_subject("a", limit=3) == [0, 1, 2]
    assert buffer.take_subject("a") == [3, 4]
    assert buffer.take_subject("a") == []
    assert len(buffer) == 1
    assert buffer.due_in(2.0) is not None
    assert buffer.take_subject("b") == [9]
    assert len(buffer) == 0
    assert buffer.due_in(2.0) is None
