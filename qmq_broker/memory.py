"""Giving memory back to the OS when a burst of connections has ended (glibc only).

A parked long poll holds uvicorn's connection, the ASGI stack of its request and the pull.
When a burst of them ends the objects are freed, but neither
CPython's allocator nor glibc's heap hands the pages back by itself: RSS stays at the
burst's peak (the next burst reuses it, so it does not grow). ``malloc_trim(0)`` releases
glibc's free pages; CPython's own small-object arenas are released only when wholly empty,
which a few survivors in each prevent, so a broker started with ``PYTHONMALLOC=malloc``
gives back much more (docs/broker.md, Limits, has the measurements).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)``, or None where there is none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def release() -> None:
        trim(0)

    return release


def rss_mb() -> float:
    """This process's resident set size in MB (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


class AfterBurst:
    """Runs ``release`` on a worker thread after a burst: once a level (open connections,
    say) that rose by ``min_burst`` or more has fallen back to a quarter of its peak and
    stayed there for ``settle_s`` (what the burst held is freed by then, not while its
    requests are still unwinding). Call ``level`` on the event loop."""

    def __init__(
        self, release: Callable[[], None], *, min_burst: int = 1000, settle_s: float = 2.0
    ) -> None:
        self._release = release
        self._min_burst = min_burst
        self._settle_s = settle_s
        self._peak = 0
        self._timer: asyncio.TimerHandle | None = None

    def level(self, value: int) -> None:
        if value > self._peak:
            self._peak = value
            if self._timer is not None:  # a new burst: wait for its end instead
                self._timer.cancel()
                self._timer = None
        elif self._peak - value >= self._min_burst and value <= self._peak // 4:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(self._settle_s, self._settled)

    def _settled(self) -> None:
        self._timer = None
        self._peak = 0  # the next rise is measured from here
        asyncio.get_running_loop().run_in_executor(None, self._run)

    def _run(self) -> None:
        before, began = rss_mb(), time.perf_counter()
        self._release()
        logger.info(
            "memory given back after a burst",
            extra={
                "action": "broker.memory_released",
                "rss_mb_before": round(before, 1),
                "rss_mb_after": round(rss_mb(), 1),
                "seconds": round(time.perf_counter() - began, 4),
            },
        )
