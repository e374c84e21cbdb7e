"""Long polls as suspend/resume: parked requests cost no worker until data or timeout."""

from __future__ import annotations

import asyncio

import pytest

from qmq_broker.errors import Unavailable
from qmq_broker.pulls import FairScheduler, FifoScheduler, ManualClock, PullScheduler
from qmq_broker.pulls.request import PullStatus
from tests.unit.scheduler_fakes import ScriptedProcessor, pull, run_next, run_until_idle


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def processor(clock: ManualClock) -> ScriptedProcessor:
    return ScriptedProcessor(clock)


@pytest.fixture(params=["fair", "fifo"])
def scheduler(
    request: pytest.FixtureRequest, clock: ManualClock, processor: ScriptedProcessor
) -> PullScheduler:
    kind = FairScheduler if request.param == "fair" else FifoScheduler
    return kind(processor=processor, clock=clock, workers=1)


async def test_an_empty_pull_is_suspended_then_resumed_by_new_data(
    scheduler: PullScheduler, clock: ManualClock, processor: ScriptedProcessor
) -> None:
    future = pull(scheduler, "g", wait_s=10)
    assert await run_until_idle(scheduler) == ["g"]
    actor = scheduler.actor("s", "g")
    assert not future.done()
    assert actor.parked_count == 1
    assert actor.suspended_since is not None
    assert scheduler.next_run() is None  # suspended: nothing for a worker to do
    calls = len(processor.calls)
    clock.advance(2.0)
    assert len(processor.calls) == calls  # no polling while suspended
    processor.add("g", 3)
    scheduler.wake_subject("s")
    assert await run_until_idle(scheduler) == ["g"]
    assert future.result() == ["g-0"]
    assert actor.parked_count == 0
    assert actor.suspended_s == pytest.approx(2.0, abs=0.01)
    assert actor.pending == 0


async def test_a_wake_on_another_subject_does_nothing(
    scheduler: PullScheduler, processor: ScriptedProcessor
) -> None:
    future = pull(scheduler, "g", wait_s=10)
    await run_until_idle(scheduler)
    scheduler.wake_subject("other")
    assert scheduler.next_run() is None
    assert not future.done()


async def test_the_timeout_resumes_with_an_empty_answer(
    scheduler: PullScheduler, clock: ManualClock, processor: ScriptedProcessor
) -> None:
    short = pull(scheduler, "g", wait_s=1.0)
    long = pull(scheduler, "g", wait_s=5.0)
    await run_until_idle(scheduler)
    assert clock.pending() == [pytest.approx(clock.now() + 1.0, abs=0.01)]
    clock.advance(0.9)
    assert scheduler.next_run() is None
    clock.advance(0.2)  # the first wait ends: its timer resumes the actor
    await run_until_idle(scheduler)
    assert short.result() == []
    assert not long.done()  # the other one stays parked, with its own timer
    clock.advance(4.0)
    await run_until_idle(scheduler)
    assert long.result() == []
    assert clock.pending() == []


async def test_a_retry_coming_due_resumes_the_group(
    scheduler: PullScheduler, clock: ManualClock, processor: ScriptedProcessor
) -> None:
    processor.wake_at["g"] = clock.now() + 0.5  # e.g. a nacked message's retry time
    future = pull(scheduler, "g", wait_s=10)
    await run_until_idle(scheduler)
    processor.add("g", 1)  # becomes visible only through the wake-up, no wake_subject
    clock.advance(0.6)
    await run_until_idle(scheduler)
    assert future.result() == ["g-0"]


async def test_one_message_wakes_one_waiter_not_all(
    scheduler: PullScheduler, processor: ScriptedProcessor
) -> None:
    futures = [pull(scheduler, "g", wait_s=10) for _ in range(100)]
    await run_until_idle(scheduler)
    assert scheduler.actor("s", "g").parked_count == 100
    processor.add("g", 1)
    before = len(processor.calls)
    scheduler.wake_subject("s")
    await run_until_idle(scheduler)
    # the oldest waiter gets it; the next one looks, finds nothing, and stops the chain
    assert len(processor.calls) - before == 2
    assert futures[0].result() == ["g-0"]
    assert not any(f.done() for f in futures[1:])
    assert scheduler.actor("s", "g").parked_count == 99


async def test_broadcast_consumers_are_woken_each(
    scheduler: PullScheduler, processor: ScriptedProcessor
) -> None:
    futures = {key: pull(scheduler, "g", key=key, wait_s=10) for key in ("c1", "c2", "c3")}
    await run_until_idle(scheduler)
    for key in futures:
        processor.add("g", 1, key=key)
    scheduler.wake_subject("s")
    await run_until_idle(scheduler)
    assert all(f.result() == ["g-0"] for f in futures.values())


async def test_a_cancelled_long_poll_leaves_the_mailbox(
    scheduler: PullScheduler, clock: ManualClock
) -> None:
    future = pull(scheduler, "g", wait_s=10)
    await run_until_idle(scheduler)
    future.cancel()
    await asyncio.sleep(0)  # lets the done callback run
    actor = scheduler.actor("s", "g")
    assert actor.pending == 0
    assert actor.parked_count == 0
    assert clock.pending() == []  # its timer is gone too
    assert await run_until_idle(scheduler) == []


async def test_drain_answers_every_parked_long_poll(
    scheduler: PullScheduler, processor: ScriptedProcessor
) -> None:
    futures = [pull(scheduler, "g", wait_s=30) for _ in range(3)]
    await run_until_idle(scheduler)
    scheduler.drain()
    await run_until_idle(scheduler)
    assert [f.result() for f in futures] == [[], [], []]


async def test_close_fails_what_is_still_pending(scheduler: PullScheduler) -> None:
    queued = pull(scheduler, "g", wait_s=30)
    scheduler.close()
    with pytest.raises(Exception, match="shutting down") as info:
        queued.result()
    assert isinstance(info.value, Unavailable)  # answered 503


async def test_within_one_slice_a_key_that_found_nothing_is_not_probed_again(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = FairScheduler(processor=processor, clock=clock, workers=1)
    for _ in range(50):
        pull(scheduler, "g", wait_s=10)
    await run_until_idle(scheduler)
    assert processor.calls.count("g") == 1  # one probe, 49 parked without one
    assert scheduler.actor("s", "g").parked_count == 50
    statuses = {r.status for r in scheduler.actor("s", "g").live()}
    assert statuses == {PullStatus.PARKED}


async def test_a_suspended_group_does_not_delay_another(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = FairScheduler(processor=processor, clock=clock, workers=1)
    for _ in range(1000):
        pull(scheduler, "idle", wait_s=30)
    await run_until_idle(scheduler)
    processor.add("busy", 10)
    future = pull(scheduler, "busy")
    assert await run_next(scheduler) == "busy"
    assert future.result() == ["busy-0"]
