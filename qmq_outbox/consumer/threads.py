"""Named daemon threads that run blocking calls for the consumer's event loop.

Sync handlers (and sync stores) run on ``concurrency`` of them; a blocking client's pulls,
acks and nacks on a pool of their own. Daemon threads, unlike ``ThreadPoolExecutor``'s: a
handler still running at the stop timeout is abandoned (its lease expires), as documented,
and does not keep the process alive.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


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
        """``fn(*args)`` on one of the threads; its result or exception comes back here.

        The thread settles the caller's asyncio future itself, through the loop: no
        ``concurrent.futures.Future`` chained to it (a lock, a condition and callbacks
        each way for every call)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return await future

    def close(self) -> None:
        """Let the threads end once the queued calls are done; does not wait for them."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            if future.cancelled():
                continue  # its caller was cancelled before the call started
            try:
                result = fn(*args)
            except BaseException as exc:
                _settle(loop, future, None, exc)
            else:
                _settle(loop, future, result, None)


def _settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    """From a pool thread: hand the call's outcome to its future on the loop's thread."""
    try:
        loop.call_soon_threadsafe(_set, future, result, error)
    except RuntimeError:
        pass  # the loop is closed: nobody waits for this call any more (abandoned at a stop)


def _set(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future cannot hold one
        future.set_exception(RuntimeError(f"the call raised {error!r}"))
    else:
        future.set_exception(error)
