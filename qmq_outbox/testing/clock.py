"""A wall clock that moves only when a test says so."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime


class StepClock:
    """Seconds since the epoch, standing still until ``advance``; starts at the current whole
    second (or ``start``).

    A whole second is exact as a float, so a time computed from it (a ``deliver_at`` of
    ``clock() + 300`` as a datetime, say) lands on the microsecond the broker computes after
    ``advance(300)``; a fractional start could be a microsecond apart once rounded.

    Pass it as ``InMemoryBroker(clock=...)`` to expire leases and bring retries and delayed
    messages due without sleeping; long polls parked on the broker re-check when it moves.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = float(int(time.time())) if start is None else start.timestamp()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def on_advance(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after each ``advance`` (the broker wakes its long polls)."""
        with self._lock:
            self._listeners.append(listener)
