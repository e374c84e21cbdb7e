"""Named daemon threads that run blocking calls for the consumer's event loop.

Sync handlers (and sync stores) run on ``concurrency`` of them; a blocking client's pulls,
acks and nacks on a pool of their own. Daemon threads, unlike ``ThreadPoolExecutor``'s: a
handler still running at the stop timeout is abandoned (its lease expires), as documented,
and does not keep the process alive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class ThreadPool:
    """``size`` threads named ``<name>-<n>``, started by ``start()``, ended by ``close()``."""

    def __init__(self, size: int, *, name: str) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True)
            for index in range(size)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    async def run(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` on one of the threads; its result or exception comes back here."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Let the threads end once the queued calls are done; does not wait for them."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # its caller was cancelled before the call started
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
