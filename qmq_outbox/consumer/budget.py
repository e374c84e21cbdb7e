"""Bounded prefetch: a consumer never holds more leases than ``capacity``.

A puller reserves slots before it pulls (asking the broker for at most that many) and gives
back what the broker did not fill; a slot comes back when the broker has been told the
message's fate (its ack sent, or its nack). So at most ``concurrency + prefetch`` leases are
held at any time, a slow handler does not hoard the group's messages, and the rest stay
with the broker for other consumers. A puller that finds no slot first hurries the acker
(``on_starved``), so batched acks never hold the consumer up for long.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


def grant(want: int, *, capacity: int, used: int) -> int:
    """How many of ``want`` slots can be had now."""
    return max(0, min(want, capacity - used))


def next_want(*, last_pulled: int, max_batch: int) -> int:
    """Ask for one message after an empty pull (an idle subject's long poll then holds a
    single slot, not a batch other subjects could use), for a full batch otherwise."""
    return max_batch if last_pulled > 0 else 1


class LeaseBudget:
    """Thread-safe slot counter; ``close()`` wakes and refuses waiting reservers."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._used = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def acquire(self, want: int, on_starved: Callable[[], None] | None = None) -> int:
        """Block until at least one slot is free; returns how many were taken, 0 if closed.

        ``on_starved`` is called (without this budget's lock) before waiting for a slot.
        """
        with self._cond:
            got = self._take(want)
        if got is not None:
            return got
        if on_starved is not None:
            on_starved()
        with self._cond:
            while not self._closed and self._used >= self.capacity:
                self._cond.wait()
            return self._take(want) or 0

    def _take(self, want: int) -> int | None:
        if self._closed:
            return 0
        got = grant(want, capacity=self.capacity, used=self._used)
        if got == 0:
            return None
        self._used += got
        return got

    def release(self, count: int) -> None:
        if count == 0:
            return
        with self._cond:
            self._used -= count
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class AsyncLeaseBudget:
    """The same counter for one event loop."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._used = 0
        self._closed = False
        self._cond = asyncio.Condition()

    @property
    def used(self) -> int:
        return self._used

    async def acquire(self, want: int, on_starved: Callable[[], None] | None = None) -> int:
        async with self._cond:
            if not self._closed and self._used >= self.capacity and on_starved is not None:
                on_starved()
            await self._cond.wait_for(lambda: self._closed or self._used < self.capacity)
            if self._closed:
                return 0
            got = grant(want, capacity=self.capacity, used=self._used)
            self._used += got
            return got

    async def release(self, count: int) -> None:
        if count == 0:
            return
        async with self._cond:
            self._used -= count
            self._cond.notify_all()

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
