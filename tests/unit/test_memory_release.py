"""When the broker gives memory back: once after a burst has ended and settled."""

from __future__ import annotations

import asyncio
import threading

from qmq_broker.memory import AfterBurst, malloc_trim, rss_mb


async def test_memory_is_released_once_after_a_burst_has_settled() -> None:
    released = threading.Semaphore(0)
    calls: list[int] = []

    def release() -> None:
        calls.append(1)
        released.release()

    watch = AfterBurst(release, min_burst=100, settle_s=0.05)
    for level in range(0, 1001):
        watch.level(level)
    for level in range(1000, 300, -1):
        watch.level(level)  # not yet down to a quarter of the peak
    await asyncio.sleep(0.1)
    assert calls == []
    for level in range(300, -1, -1):
        watch.level(level)
    assert calls == []  # still settling
    assert await asyncio.to_thread(released.acquire, timeout=5)
    await asyncio.sleep(0.1)
    assert calls == [1]  # once per burst, not once per closed connection


async def test_small_swings_release_nothing() -> None:
    calls: list[int] = []
    watch = AfterBurst(lambda: calls.append(1), min_burst=100, settle_s=0.01)
    for _ in range(5):
        for level in (50, 0):
            watch.level(level)
    await asyncio.sleep(0.05)
    assert calls == []


async def test_a_new_burst_postpones_the_release() -> None:
    calls: list[int] = []
    watch = AfterBurst(lambda: calls.append(1), min_burst=100, settle_s=0.05)
    watch.level(1000)
    watch.level(100)
    watch.level(2000)  # a bigger burst starts before the first one settled
    await asyncio.sleep(0.1)
    assert calls == []


def test_malloc_trim_runs_where_glibc_has_it() -> None:
    trim = malloc_trim()
    if trim is not None:
        trim()
    assert rss_mb() > 0
