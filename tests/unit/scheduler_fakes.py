"""A scripted processor and helpers for driving the pull schedulers on a ``ManualClock``.

The processor advances the manual clock by each group's cost per request (its "service
time"; its work too, unless ``work`` says how much of it was CPU), hands out messages from
per-(subject, group, key) counters and records every call, so tests can assert the exact
order in which the scheduler served the groups.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from qmq_broker.pulls import ManualClock, PullOutcome, PullScheduler, QueuedPull, Served


class ScriptedProcessor:
    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.cost: dict[str, float] = defaultdict(lambda: 0.001)  # seconds per request, by group
        # CPU per request, by group, when it is not all of the cost (the rest is waiting)
        self.work: dict[str, float] = {}
        self.available: dict[tuple[str, str, str], int] = defaultdict(int)
        self.wake_at: dict[str, float] = {}  # group -> PullOutcome.wake_at when nothing is there
        self.calls: list[str] = []  # group of every call, in order

    def add(self, group: str, count: int, *, subject: str = "s", key: str = "") -> None:
        self.available[(subject, group, key)] += count

    async def __call__(self, requests: Sequence[QueuedPull]) -> Served:
        outcomes = [self._serve(request) for request in requests]
        work = sum(self.work.get(request.group, self.cost[request.group]) for request in requests)
        return Served(outcomes, work)

    def _serve(self, request: QueuedPull) -> PullOutcome:
        self.calls.append(request.group)
        self.clock.advance(self.cost[request.group])
        slot = (request.subject, request.group, request.key)
        have = self.available[slot]
        if not have:
            return PullOutcome(None, wake_at=self.wake_at.get(request.group))
        take = min(have, request.max_messages)
        self.available[slot] -= take
        return PullOutcome([f"{request.group}-{n}" for n in range(take)])


def pull(
    scheduler: PullScheduler,
    group: str,
    *,
    subject: str = "s",
    key: str = "",
    wait_s: float = 0.0,
    max_messages: int = 1,
) -> asyncio.Future[list[Any]]:
    return scheduler.submit(
        subject=subject,
        group=group,
        key=key,
        consumer=key or "c",
        max_messages=max_messages,
        wait_s=wait_s,
    )


async def run_next(scheduler: PullScheduler) -> str | None:
    """Run whatever the scheduler picks next; the group it ran, or None when idle."""
    picked = scheduler.next_run()
    if picked is None:
        return None
    await scheduler.run(*picked)
    return picked[0].group


async def run_until_idle(scheduler: PullScheduler, limit: int = 10_000) -> list[str]:
    ran: list[str] = []
    for _ in range(limit):
        group = await run_next(scheduler)
        if group is None:
            return ran
        ran.append(group)
    raise AssertionError("scheduler never went idle")
