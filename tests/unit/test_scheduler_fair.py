"""FairScheduler on a manual clock: priority order, slice yield, min-vruntime clamp, shares."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest

from qmq_broker.pulls import (
    FairScheduler,
    FifoScheduler,
    ManualClock,
    PullOutcome,
    PullScheduler,
    QueuedPull,
    Served,
)
from qmq_broker.pulls.scheduler import LONG_RUN_DECAY
from tests.unit.scheduler_fakes import ScriptedProcessor, pull, run_next, run_until_idle


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def processor(clock: ManualClock) -> ScriptedProcessor:
    return ScriptedProcessor(clock)


def fair(clock: ManualClock, processor: ScriptedProcessor, **kwargs: Any) -> FairScheduler:
    return FairScheduler(processor=processor, clock=clock, workers=1, **kwargs)


async def test_lowest_virtual_runtime_runs_first(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    # a slice shorter than any request: every run serves exactly one request; costs are
    # binary fractions of a second (~1 ms) so equal sums are exactly equal
    unit = 2**-10
    scheduler = fair(clock, processor, time_slice_s=unit / 2)
    processor.cost.update(a=4 * unit, b=unit, c=2 * unit)
    for group in "abc":
        processor.add(group, 100)
        for _ in range(20):
            pull(scheduler, group)
    ran = []
    for _ in range(11):
        queue = scheduler.runnable()
        assert queue[0].vruntime == min(actor.vruntime for actor in queue)
        ran.append(await run_next(scheduler))
        assert ran[-1] == queue[0].group
    # vruntime after each run: a 4, b 1, c 2, b 2, c 4, b 3, b 4, a 8, c 6, b 5, b 6 units;
    # equal vruntimes go in the order the actors were (re)submitted
    assert "".join(ran) == "abcbcbbacbb"


async def test_ties_are_broken_by_submit_time(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = fair(clock, processor)
    for group in ("late", "early"):
        scheduler.actor("s", group)  # both exist at the same virtual runtime
    processor.add("early", 1)
    processor.add("late", 1)
    pull(scheduler, "early")
    clock.advance(0.001)
    pull(scheduler, "late")
    assert await run_until_idle(scheduler) == ["early", "late"]


async def test_a_run_yields_after_its_time_slice(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = fair(clock, processor, time_slice_s=0.005)
    processor.cost["a"] = 0.002
    processor.add("a", 100)
    futures = [pull(scheduler, "a") for _ in range(10)]
    assert await run_next(scheduler) == "a"
    # 2 ms + 2 ms < 5 ms, the third request crosses the slice: three served, then it yields
    assert sum(f.done() for f in futures) == 3
    actor = scheduler.actor("s", "a")
    assert actor.runs == 1
    assert actor.service_s == pytest.approx(0.006)
    assert actor.runnable  # back in the queue with 7 requests left
    assert len(actor.mailbox) == 7


async def test_requests_are_served_in_batches_sized_by_recent_cost(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """One hand-off to the read pool serves as many requests as fit in the slice."""
    sizes: list[int] = []
    serve = processor.__call__

    async def recording(requests: Sequence[QueuedPull]) -> Served:
        sizes.append(len(requests))
        return await serve(requests)

    unit = 2**-10  # ~1 ms, exact in binary
    scheduler = FairScheduler(processor=recording, clock=clock, time_slice_s=5 * unit)
    processor.cost["a"] = unit
    processor.add("a", 100)
    for _ in range(20):
        pull(scheduler, "a")
    await run_next(scheduler)
    assert sizes == [1, 4]  # cost unknown: one; then 1 ms each fits four in the 4 ms left
    await run_next(scheduler)
    assert sizes[2] == 5  # a fresh slice: five


async def test_a_costly_group_is_pushed_back(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """A group whose pulls cost more work gets fewer turns, not more time."""
    scheduler = fair(clock, processor, time_slice_s=0.005)
    processor.cost.update(cold=0.020, hot=0.001)
    for group in ("cold", "hot"):
        processor.add(group, 10_000)
        for _ in range(1000):
            pull(scheduler, group)
    ran = [await run_next(scheduler) for _ in range(40)]
    cold, hot = scheduler.actor("s", "cold"), scheduler.actor("s", "hot")
    # a cold run is one 20 ms request, a hot run five 1 ms requests: equal time, 4x the turns
    assert ran.count("hot") >= 3 * ran.count("cold")
    assert abs(cold.service_s - hot.service_s) <= 0.020 + 0.005  # within one read + one slice


async def test_a_group_is_charged_its_work_not_its_waits(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """A run's wall time also holds its waits (for a read thread, for the GIL), as long for
    a lone small pull as for a batch: two groups whose pulls cost the same work are served
    as many pulls, though one's runs wait four times as long per pull."""
    scheduler = fair(clock, processor, time_slice_s=0.005)
    processor.cost.update(waits=0.004, batched=0.001)
    processor.work.update(waits=0.001, batched=0.001)
    for group in ("waits", "batched"):
        processor.add(group, 10_000)
        for _ in range(1000):
            pull(scheduler, group)
    for _ in range(60):
        await run_next(scheduler)
    served = Counter(processor.calls)
    # a run of "waits" serves 2 pulls in 8 ms, one of "batched" 5 in 5 ms; charged by wall
    # time, "waits" would get 5 pulls for every 8 of "batched"
    assert served["waits"] == pytest.approx(served["batched"], rel=0.1)
    waits, batched = scheduler.actor("s", "waits"), scheduler.actor("s", "batched")
    assert abs(waits.work_s - batched.work_s) <= 0.005
    assert waits.service_s > 3 * waits.work_s  # the waits are still in its wall time


async def test_a_woken_actor_starts_at_the_minimum_virtual_runtime(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """A group quiet for a long time must not get all that time back in one burst."""
    scheduler = fair(clock, processor, time_slice_s=0.005)
    processor.cost.update(busy=0.006, quiet=0.006)  # one request per 5 ms slice
    processor.add("busy", 10_000)
    processor.add("quiet", 10_000)
    pull(scheduler, "quiet")
    await run_until_idle(scheduler)  # quiet ran once, then went idle
    for _ in range(200):
        pull(scheduler, "busy")
    for _ in range(100):
        await run_next(scheduler)  # busy runs alone for 100 slices: vruntime ~0.6 s
    busy = scheduler.actor("s", "busy")
    quiet = scheduler.actor("s", "quiet")
    assert quiet.vruntime < busy.vruntime - 0.4
    for _ in range(50):
        pull(scheduler, "quiet")  # the burst
    assert quiet.vruntime >= busy.vruntime
    order = [await run_next(scheduler) for _ in range(10)]
    assert order.count("busy") == 5  # they alternate; quiet does not monopolise the worker
    assert scheduler.min_vruntime() <= min(busy.vruntime, quiet.vruntime)


async def test_min_vruntime_never_decreases(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = fair(clock, processor)
    processor.add("a", 10)
    pull(scheduler, "a")
    seen = [scheduler.min_vruntime()]
    for _ in range(5):
        pull(scheduler, "a")
        await run_next(scheduler)
        seen.append(scheduler.min_vruntime())
    assert seen == sorted(seen)
    new = scheduler.actor("s", "new")
    assert new.vruntime == scheduler.min_vruntime()  # a new actor starts at the floor


async def closed_loop(
    scheduler: PullScheduler, consumers: dict[str, int], runs: int
) -> Counter[str]:
    """Every consumer pulls again as soon as it is answered (saturation); count deliveries."""
    delivered: Counter[str] = Counter()

    def again(group: str, future: asyncio.Future[list[Any]]) -> None:
        delivered[group] += len(future.result())
        pull(scheduler, group).add_done_callback(partial(again, group))

    for group, count in consumers.items():
        for _ in range(count):
            pull(scheduler, group).add_done_callback(partial(again, group))
    for _ in range(runs):
        await run_next(scheduler)
        await asyncio.sleep(0)  # let answered consumers pull again
    return delivered


async def test_group_share_does_not_follow_its_consumer_count(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    processor.cost.update(a=0.0025, b=0.0025)
    processor.add("a", 10**9)
    processor.add("b", 10**9)
    fifo = FifoScheduler(processor=processor, clock=clock, workers=1)
    fifo_counts = await closed_loop(fifo, {"a": 100, "b": 2}, runs=3000)
    fifo_share = fifo_counts["b"] / sum(fifo_counts.values())
    assert fifo_share == pytest.approx(2 / 102, abs=0.01)

    fair_scheduler = FairScheduler(processor=processor, clock=clock, workers=1)
    fair_counts = await closed_loop(fair_scheduler, {"a": 100, "b": 2}, runs=3000)
    fair_share = fair_counts["b"] / sum(fair_counts.values())
    assert fair_share >= 0.40


async def closed_loop_with_round_trips(
    scheduler: FairScheduler,
    clock: ManualClock,
    consumers: dict[str, int],
    *,
    round_trip_s: float,
    seconds: float,
) -> Counter[str]:
    """Each consumer pulls again ``round_trip_s`` after its answer (the way back through
    the network and its client); an idle worker waits for the next timer. Deliveries."""
    delivered: Counter[str] = Counter()

    def again(group: str, future: asyncio.Future[list[Any]]) -> None:
        delivered[group] += len(future.result())
        clock.call_at(clock.now() + round_trip_s, partial(start, group))

    def start(group: str) -> None:
        pull(scheduler, group).add_done_callback(partial(again, group))

    for group, count in consumers.items():
        for _ in range(count):
            start(group)
    end = clock.now() + seconds
    while clock.now() < end:
        if await run_next(scheduler) is None:
            pending = clock.pending()
            clock.advance(max(pending[0] - clock.now(), 0.0) if pending else round_trip_s)
        await asyncio.sleep(0)  # answered consumers schedule their next pull
    return delivered


@pytest.mark.parametrize("max_messages", [1, 10])
async def test_a_few_consumers_coming_back_keep_their_group_share_at_small_pulls(
    clock: ManualClock, processor: ScriptedProcessor, max_messages: int
) -> None:
    """100 consumers against 2, every pull small: the 2 are away (their round trip) after
    each answer; without anticipation the 100 take nearly every turn meanwhile."""
    processor.cost.update(a=0.0001, b=0.0001)
    processor.add("a", 10**9)
    processor.add("b", 10**9)
    shares = {}
    for anticipation in (0.0, 0.002):
        scheduler = fair(clock, processor, time_slice_s=0.005, anticipation_s=anticipation)
        counts = await closed_loop_with_round_trips(
            scheduler, clock, {"a": 100, "b": 2}, round_trip_s=0.0005, seconds=2.0
        )
        shares[anticipation] = counts["b"] / sum(counts.values())
    assert shares[0.0] < 0.2  # the flaw anticipation fixes
    assert shares[0.002] >= 0.45


async def test_charged_work_counts_toward_a_groups_share(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    scheduler = fair(clock, processor, time_slice_s=0.001)
    processor.cost.update(a=0.001, b=0.001)
    processor.add("a", 100)
    processor.add("b", 100)
    for _ in range(10):
        pull(scheduler, "a")
        pull(scheduler, "b")
    scheduler.charge("s", "a", 0.010)  # a's answers cost 10 ms to encode, say
    scheduler.charge("s", "nobody", 1.0)  # no such actor: ignored
    assert scheduler.actor("s", "a").charged_s == 0.010
    ran = [await run_next(scheduler) for _ in range(10)]
    # a runs first (its queue entry predates the charge); then b has every turn until it
    # has caught up on a's lead (b's 10 requests take 5 runs), where they would alternate
    assert ran == ["a"] + ["b"] * 5 + ["a"] * 4


async def test_a_run_counts_each_requests_work_outside_it_against_the_slice(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """A request whose answer costs as much to encode as to read takes half a slice's
    requests: answering one slice's requests then takes about a slice."""
    scheduler = fair(clock, processor, time_slice_s=0.010)
    processor.cost.update(a=0.001)
    processor.add("a", 1_000)
    for _ in range(100):
        pull(scheduler, "a")
    await run_next(scheduler)
    served_plain = len(processor.calls)
    assert served_plain >= 9  # 10 ms of 1 ms requests
    for _ in range(30):
        scheduler.charge("s", "a", 0.001)  # each answer costs 1 ms outside the run
    processor.calls.clear()
    await run_next(scheduler)
    assert 4 <= len(processor.calls) <= 6


async def test_an_actor_ahead_of_a_present_one_waits_for_it(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """Any lead holds an actor back while a group answered moments ago is coming back: with
    small pulls, a slice of lead is many answers, and as many requests read from the other
    group's consumers meanwhile."""
    scheduler = fair(clock, processor, time_slice_s=0.005, anticipation_s=0.010)
    processor.cost.update(a=0.002, b=0.001)
    processor.add("a", 100)
    processor.add("b", 100)
    pull(scheduler, "a")
    pull(scheduler, "b")
    assert await run_until_idle(scheduler) == ["a", "b"]  # both answered, both present
    a, b = scheduler.actor("s", "a"), scheduler.actor("s", "b")
    assert a.vruntime - b.vruntime == pytest.approx(0.001)  # a leads by a fifth of a slice
    pull(scheduler, "a")
    assert scheduler.next_run() is None  # a waits for b's consumers
    pull(scheduler, "b")  # b is back
    assert await run_next(scheduler) == "b"
    assert await run_next(scheduler) == "a"


async def test_a_present_group_is_waited_for_as_long_as_a_run_may_delay_it(
    clock: ManualClock, processor: ScriptedProcessor
) -> None:
    """Its consumers' next pulls may wait for a run under way to end: presence lasts
    ``anticipation_s`` plus the longest recent run."""
    scheduler = fair(clock, processor, time_slice_s=0.005, anticipation_s=0.002)
    processor.cost.update(a=0.004, b=0.001)
    processor.add("a", 100)
    processor.add("b", 100)
    pull(scheduler, "b")
    assert await run_next(scheduler) == "b"  # b answered: present
    pull(scheduler, "a")
    pull(scheduler, "a")
    assert await run_next(scheduler) == "a"  # two 4 ms requests: an 8 ms run
    pull(scheduler, "b")  # b is back (its consumers' pulls waited for a's run)
    assert await run_next(scheduler) == "b"
    b = scheduler.actor("s", "b")
    longest = 0.008 * LONG_RUN_DECAY  # a's run, decayed by b's since
    assert b.present_until == pytest.approx(clock.now() + 0.002 + longest)
    pull(scheduler, "a")
    clock.advance(0.009)  # b's consumers are late by about a run: b still counts
    assert scheduler.next_run() is None  # a (ahead) waits
    clock.advance(0.002)
    assert await run_next(scheduler) == "a"  # b stopped counting


async def test_a_worker_lets_the_loop_run_between_runs(clock: ManualClock) -> None:
    """A run whose reads never wait (all cached) does not await; the worker yields after
    it, so answers are written and new requests read before the next run."""
    ticks = 0
    seen: list[int] = []

    async def synchronous(requests: Sequence[QueuedPull]) -> Served:
        seen.append(ticks)
        clock.advance(0.010)  # past the slice: one batch per run
        return Served([PullOutcome(["m"]) for _ in requests], 0.001)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    scheduler = FairScheduler(processor=synchronous, clock=clock, workers=1)
    for _ in range(5):
        pull(scheduler, "a")
        pull(scheduler, "b")
    tasks = [asyncio.create_task(scheduler.run_worker()), asyncio.create_task(ticker())]
    try:
        for _ in range(50):
            await asyncio.sleep(0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert len(seen) >= 3
    assert all(later > earlier for earlier, later in itertools.pairwise(seen))
