"""Wake-ups for long-polling pulls: one signal per subject, fired when anything changes."""

from __future__ import annotations

import asyncio
import contextlib


class Signal:
    """Waiters block until the next ``fire()`` or their timeout; firing wakes all of them."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    async def wait(self, seconds: float) -> bool:
        """True when fired, False on timeout."""
        if seconds <= 0:
            return False
        if self._future is None or self._future.done():
            self._future = asyncio.get_running_loop().create_future()
        future = self._future
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(future), seconds)
            return True
        return False

    def fire(self) -> None:
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_result(None)
