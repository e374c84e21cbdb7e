"""Poll-with-deadline helpers: wait for a condition instead of sleeping a fixed time."""

from __future__ import annotations

import asyncio
import time
from typing import Any


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.005) -> None:
    """Poll ``predicate`` until true or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


async def wait_until_async(predicate: Any, within: float = 5.0, interval: float = 0.005) -> None:
    """``wait_until`` without blocking the loop."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(interval)
