"""The broker's one clock: wall time, a monotonic scale and one-shot timers, injectable.

``wall_us()`` is wall-clock time in microseconds since the epoch: stored_at stamps, lease
deadlines, retry and delivery due times (they are written to disk and must survive a
restart). ``now()`` and ``call_at()`` are the pull scheduler's monotonic seconds and timers.
Slices are 5 ms long, so service time is measured with ``time.monotonic`` (nanosecond
resolution) and not with the event loop's ``time()`` (uvloop's has millisecond steps).
Timers only resume long polls, where a millisecond of slack does not matter, so they run
on the loop's ``call_later``. ``ManualClock`` replaces both in unit tests: time moves only
when the test says so and due timers fire in order, which makes schedules reproducible.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Wall time, monotonic seconds and one-shot timers at an absolute monotonic time."""

    def wall_us(self) -> int: ...

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer: ...


class SystemClock:
    """The system's clocks, with timers on the running asyncio loop (call from the loop)."""

    def wall_us(self) -> int:
        return time.time_ns() // 1000

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        delay = max(when - time.monotonic(), 0.0)
        return asyncio.get_running_loop().call_later(delay, callback)


class _ManualTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that stands still until ``advance``; timers fire inside ``advance``.

    Wall time moves with it: ``wall_us()`` is ``wall_start_us`` plus the seconds advanced.
    """

    def __init__(self, start: float = 1000.0, *, wall_start_us: int = 0) -> None:
        self._start = start
        self._wall_start_us = wall_start_us
        self._now = start
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def wall_us(self) -> int:
        return self._wall_start_us + round((self._now - self._start) * 1_000_000)

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, firing every timer that comes due on the way, in order."""
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer.callback()
        self._now = target

    def pending(self) -> list[float]:
        """When the live timers are due (for assertions)."""
        return sorted(when for when, _, timer in self._timers if not timer.cancelled)
