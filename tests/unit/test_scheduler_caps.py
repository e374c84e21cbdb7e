"""The broker-wide cap on pending pulls, the totals behind its gauges, and parked long polls
giving their memory back when they end."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from qmq_broker.errors import Overloaded
from qmq_broker.pulls import (
    ActorMetrics,
    FairScheduler,
    FifoScheduler,
    MailboxFull,
    ManualClock,
    PullScheduler,
    TooManyPulls,
)
from tests.unit.scheduler_fakes import ScriptedProcessor, pull, run_until_idle


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def processor(clock: ManualClock) -> ScriptedProcessor:
    return ScriptedProcessor(clock)


@pytest.fixture(params=[FairScheduler, FifoScheduler])
def kind(request: pytest.FixtureRequest) -> type[PullScheduler]:
    kind: type[PullScheduler] = request.param
    return kind


async def test_the_broker_wide_cap_counts_pending_pulls_of_every_group(
    kind: type[PullScheduler], clock: ManualClock, processor: ScriptedProcessor
) -> None:
    registry = CollectorRegistry()
    scheduler = kind(
        processor=processor, clock=clock, max_pending=3, metrics=ActorMetrics(registry)
    )
    first = pull(scheduler, "a", wait_s=10)
    pull(scheduler, "b", wait_s=10)
    await run_until_idle(scheduler)  # both park
    pull(scheduler, "c")  # queued, not parked: counts as well
    with pytest.raises(TooManyPulls) as info:
        pull(scheduler, "d")
    assert isinstance(info.value, Overloaded)  # answered 429
    assert info.value.code == "too_many_pulls"
    assert info.value.retry_after_s == 1
    assert (scheduler.totals.pending, scheduler.totals.parked) == (3, 2)
    assert registry.get_sample_value("qmq_broker_pulls_pending") == 3
    assert registry.get_sample_value("qmq_broker_pulls_parked") == 2
    assert registry.get_sample_value("qmq_broker_pulls_refused_total") == 1
    await run_until_idle(scheduler)  # "c" asked for no wait: answered empty
    processor.add("a", 1)
    scheduler.wake_subject("s")
    await run_until_idle(scheduler)
    assert first.result() == ["a-0"]
    pull(scheduler, "d")  # room again
    assert (scheduler.totals.pending, scheduler.totals.parked) == (2, 1)


async def test_a_group_mailbox_still_caps_its_own_group_first(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = FairScheduler(processor=processor, clock=clock, mailbox_size=1, max_pending=10)
    pull(scheduler, "a", wait_s=10)
    await run_until_idle(scheduler)
    with pytest.raises(MailboxFull):
        pull(scheduler, "a")
    pull(scheduler, "b")


async def test_totals_follow_timeouts_cancellations_and_shutdown(
    kind: type[PullScheduler], clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = kind(processor=processor, clock=clock)
    short = [pull(scheduler, "a", wait_s=1) for _ in range(3)]
    abandoned = [pull(scheduler, "b", key=f"k{n}", wait_s=30) for n in range(3)]
    kept = [pull(scheduler, "c", wait_s=30) for _ in range(2)]
    await run_until_idle(scheduler)
    assert (scheduler.totals.pending, scheduler.totals.parked) == (8, 8)
    clock.advance(1.5)
    await run_until_idle(scheduler)
    assert [f.result() for f in short] == [[], [], []]
    for future in abandoned:
        future.cancel()  # the HTTP layer cancels a pull whose client went away
    await asyncio.sleep(0)  # done callbacks run on the loop
    assert (scheduler.totals.pending, scheduler.totals.parked) == (2, 2)
    scheduler.drain()
    await run_until_idle(scheduler)
    assert [f.result() for f in kept] == [[], []]
    assert (scheduler.totals.pending, scheduler.totals.parked) == (0, 0)


async def test_parked_polls_are_forgotten_once_answered(
    kind: type[PullScheduler], clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """After a burst of long polls ends, the actor holds none of them (nor their answers)."""
    scheduler = kind(processor=processor, clock=clock)
    futures = [pull(scheduler, "g", key=f"consumer-{n}", wait_s=5) for n in range(200)]
    await run_until_idle(scheduler)
    actor = scheduler.actor("s", "g")
    assert actor.parked_count == 200
    refs: list[weakref.ref[Any]] = [weakref.ref(future) for future in futures]
    processor.add("g", 1, key="consumer-0")
    scheduler.wake_subject("s")  # every key looks once; one gets a message
    await run_until_idle(scheduler)
    clock.advance(6)  # the others time out
    await run_until_idle(scheduler)
    assert sum(1 for future in futures if future.result()) == 1
    del futures
    await asyncio.sleep(0)  # let the futures' done callbacks run
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == []
    assert actor.parked_count == 0
    assert (scheduler.totals.pending, scheduler.totals.parked) == (0, 0)
