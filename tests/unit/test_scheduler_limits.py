"""Overload answers (429 mailbox full, 503 deadline), FIFO order, metrics and the workers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from qmq_broker.errors import Overloaded, Unavailable
from qmq_broker.pulls import (
    ActorMetrics,
    DeadlineExceeded,
    FairScheduler,
    FifoScheduler,
    MailboxFull,
    ManualClock,
    PullOutcome,
    QueuedPull,
    Served,
)
from tests.unit.scheduler_fakes import ScriptedProcessor, pull, run_next, run_until_idle


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def processor(clock: ManualClock) -> ScriptedProcessor:
    return ScriptedProcessor(clock)


async def test_a_full_mailbox_answers_429_with_retry_after(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = FairScheduler(processor=processor, clock=clock, mailbox_size=2)
    first = pull(scheduler, "g", wait_s=10)
    pull(scheduler, "g", wait_s=10)
    with pytest.raises(MailboxFull) as info:
        pull(scheduler, "g", wait_s=10)
    assert isinstance(info.value, Overloaded)  # answered 429
    assert info.value.code == "mailbox_full"
    assert info.value.retry_after_s == 1
    assert scheduler.actor("s", "g").rejected == 1
    pull(scheduler, "other")  # other groups have their own mailbox
    await run_until_idle(scheduler)  # parked long polls still count against the mailbox
    with pytest.raises(MailboxFull):
        pull(scheduler, "g")
    processor.add("g", 1)
    scheduler.wake_subject("s")
    await run_until_idle(scheduler)
    assert first.result() == ["g-0"]
    pull(scheduler, "g")  # room again


@pytest.mark.parametrize("kind", [FairScheduler, FifoScheduler])
async def test_a_request_past_its_deadline_is_answered_503_not_dropped(
    kind: type[FairScheduler | FifoScheduler], clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = kind(processor=processor, clock=clock, deadline_grace_s=0.1)
    processor.cost["slow"] = 0.5
    processor.add("slow", 10)
    pull(scheduler, "slow")
    late = pull(scheduler, "slow", wait_s=0.2)  # may start until 0.3 s after arrival
    timely = pull(scheduler, "slow", wait_s=2.0)
    await run_next(scheduler)  # the first request holds the worker for 0.5 s
    calls = len(processor.calls)
    await run_until_idle(scheduler)
    with pytest.raises(DeadlineExceeded) as info:
        late.result()
    assert isinstance(info.value, Unavailable)  # answered 503
    assert info.value.code == "deadline_exceeded"
    assert timely.result() == ["slow-0"]
    assert len(processor.calls) == calls + 1  # the expired one was never served
    assert scheduler.actor("s", "slow").expired == 1


async def test_fifo_serves_requests_in_arrival_order_across_groups(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = FifoScheduler(processor=processor, clock=clock)
    for group in ("a", "b"):
        processor.add(group, 100)
    for group in "aabaaba":
        pull(scheduler, group)
    assert "".join(await run_until_idle(scheduler)) == "aabaaba"


async def test_actor_metrics_are_exported(clock: ManualClock, processor: ScriptedProcessor) -> None:
    registry = CollectorRegistry()
    scheduler = FairScheduler(
        processor=processor, clock=clock, mailbox_size=1, metrics=ActorMetrics(registry)
    )
    processor.add("g", 1)
    pull(scheduler, "g")
    with pytest.raises(MailboxFull):
        pull(scheduler, "g")
    clock.advance(0.25)
    await run_until_idle(scheduler)
    pull(scheduler, "g", wait_s=5)
    await run_until_idle(scheduler)
    clock.advance(5)
    await run_until_idle(scheduler)

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"subject": "s", "group": "g"})

    assert value("qmq_broker_actor_runs_total") == 3
    assert value("qmq_broker_actor_service_seconds_total") == pytest.approx(0.003)
    assert value("qmq_broker_actor_queue_wait_seconds_count") == 3
    assert value("qmq_broker_actor_queue_wait_seconds_sum") == pytest.approx(0.25, abs=0.01)
    assert value("qmq_broker_actor_suspended_seconds_total") == pytest.approx(5.0, abs=0.01)
    assert value("qmq_broker_actor_rejected_requests_total") == 1
    assert value("qmq_broker_actor_expired_requests_total") == 0
    assert value("qmq_broker_actor_mailbox_requests") == 0
    assert value("qmq_broker_actor_parked_requests") == 0
    assert value("qmq_broker_actor_vruntime_seconds") == pytest.approx(0.003)


@pytest.mark.parametrize("kind", [FairScheduler, FifoScheduler])
async def test_workers_sleep_when_idle_and_wake_for_new_work(
    kind: type[FairScheduler | FifoScheduler], clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = kind(processor=processor, clock=clock, workers=2)
    workers = [asyncio.create_task(scheduler.run_worker(), name=f"w{i}") for i in range(2)]
    try:
        await asyncio.sleep(0)
        processor.add("a", 5)
        processor.add("b", 5)
        answers = await asyncio.wait_for(
            asyncio.gather(*(pull(scheduler, g) for g in "abab")), timeout=5
        )
        assert sorted(m[0] for m in answers) == ["a-0", "a-0", "b-0", "b-0"]
        assert await asyncio.wait_for(pull(scheduler, "a", wait_s=1), timeout=5) == ["a-0"]
        empty = pull(scheduler, "c", wait_s=1)
        await asyncio.sleep(0.01)
        clock.advance(1)
        assert await asyncio.wait_for(empty, timeout=5) == []
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


@pytest.mark.parametrize(("kind", "most"), [(FairScheduler, 1), (FifoScheduler, 3)])
async def test_a_fair_group_never_holds_more_than_one_worker(
    kind: type[FairScheduler | FifoScheduler], most: int, clock: ManualClock
) -> None:
    """A slow group's pulls queue behind each other, leaving the other workers free."""
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    async def slow(requests: Sequence[QueuedPull]) -> Served:
        group = requests[0].group
        running[group] = running.get(group, 0) + 1
        peak[group] = max(peak.get(group, 0), running[group])
        await asyncio.sleep(0.01)  # a slow read: the worker waits, the loop does not
        running[group] -= 1
        return Served([PullOutcome([group]) for _ in requests], 0.0001)

    scheduler = kind(processor=slow, clock=clock, workers=3)
    workers = [asyncio.create_task(scheduler.run_worker()) for _ in range(3)]
    try:
        slow_pulls = [pull(scheduler, "slow") for _ in range(6)]
        await asyncio.sleep(0)
        other = pull(scheduler, "other")
        await asyncio.wait_for(asyncio.gather(*slow_pulls, other), timeout=5)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    assert peak["slow"] == most
