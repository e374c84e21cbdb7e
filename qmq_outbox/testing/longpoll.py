"""Long polls: a pull that found nothing waits, and looks again whenever something changed.

Sync clients wait on a condition of the broker's lock; async clients on an asyncio event
that ``wake`` sets from any thread. Either looks again at least when the next lease
expires, retry or delayed message comes due, or the poll's linger time ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import qmq_wire as wire


@dataclasses.dataclass(frozen=True, slots=True)
class LongPoll:
    """A pull waiting for messages, as it asked for them."""

    subject: str
    group: str
    owner: str  # the key of its state owner in the group ("" unless broadcast)
    consumer: str
    limit: int
    deadline: float  # time.monotonic()
    acks: dict[str, Any]  # the answer to the acks the pull carried, merged into its answer
    min_messages: int = 1
    linger_until: float = 0.0  # time.monotonic(); fewer than min_messages are not served before
    max_keys: int = 1  # ordered: a partition's keys with a message in flight at once


class Leases(Protocol):
    def lease(self, poll: LongPoll) -> list[wire.PulledMessageJson]: ...

    def next_due_us(self, poll: LongPoll) -> int | None:
        """When something the poll may be served next comes due, on the broker's clock."""
        ...


class LongPolls:
    def __init__(self, lock: threading.RLock, leases: Leases, now_us: Callable[[], int]) -> None:
        self._lock = lock
        self._changed = threading.Condition(lock)
        self._wakers: set[Callable[[], None]] = set()
        self._leases = leases
        self._now_us = now_us

    def wake(self) -> None:
        with self._lock:
            self._changed.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def wait(self, poll: LongPoll) -> dict[str, Any]:
        """Long-poll on the calling thread (the lock is held; ``wait`` releases it)."""
        while (timeout := self._timeout(poll)) is not None:
            self._changed.wait(timeout)
            messages = self._leases.lease(poll)
            if messages:
                return {"messages": messages, **poll.acks}
        return {"messages": [], **poll.acks}

    async def wait_async(self, poll: LongPoll) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(event.set)

        with self._lock:
            self._wakers.add(wake)
        try:
            while True:
                with self._lock:
                    timeout = self._timeout(poll)
                if timeout is None:
                    return {"messages": [], **poll.acks}
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout)
                event.clear()
                with self._lock:
                    messages = self._leases.lease(poll)
                if messages:
                    return {"messages": messages, **poll.acks}
        finally:
            with self._lock:
                self._wakers.discard(wake)

    def _timeout(self, poll: LongPoll) -> float | None:
        """Seconds to wait before looking again; None once the long poll ran out."""
        remaining = poll.deadline - time.monotonic()
        if remaining <= 0:
            return None
        due = self._leases.next_due_us(poll)
        if due:
            remaining = min(remaining, max((due - self._now_us()) / 1_000_000, 0.001))
        lingering = poll.linger_until - time.monotonic()
        if lingering > 0:
            remaining = min(remaining, lingering)
        return remaining
