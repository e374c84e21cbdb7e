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
from collections.abc import Callable


def grant(want: int, *, capacity: int, used: int) -> int:
    """How many of ``want`` slots can be had now."""
    return max(0, min(want, capacity - used))


def next_want(*, last_pulled: int, max_batch: int) -> int:
    """Ask for one message after an empty pull (an idle subject's long poll then holds a
    single slot, not a batch other subjects could use), for a full batch otherwise."""
    return max_batch if last_pulled > 0 else 1


class LeaseBudget:
    """The slot counter of one event loop (use it from the loop's thread only).

    ``release`` and ``close`` are plain calls: they only count and wake the waiters.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._used = 0
        self._closed = False
        self._freed = asyncio.Event()

    @property
    def used(self) -> int:
        return self._used

    async def acquire(self, want: int, on_starved: Callable[[], None] | None = None) -> int:
        """Wait until at least one slot is free; returns how many were taken, 0 if closed.

        ``on_starved`` is called once before waiting for a slot.
        """
        if not self._closed and self._used >= self.capacity and on_starved is not None:
            on_starved()
        while not self._closed and self._used >= self.capacity:
            self._freed.clear()
            await self._freed.wait()
        return self.try_acquire(want)

    def try_acquire(self, want: int) -> int:
        """Take up to ``want`` free slots without waiting; how many were taken (0 if closed)."""
        if self._closed:
            return 0
        got = grant(want, capacity=self.capacity, used=self._used)
        self._used += got
        return got

    def release(self, count: int) -> None:
        if count:
            self._used -= count
            self._freed.set()

    def close(self) -> None:
        """Refuse further reservations and wake the waiting ones (they get 0)."""
        self._closed = True
        self._freed.set()
