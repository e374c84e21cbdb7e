"""A wall clock that moves only when a test says so."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime


class StepClock:
    """Seconds since the epoch, standing still until ``advance``; starts at now (or ``start``).

    Pass it as ``InMemoryBroker(clock=...)`` to expire leases and bring retries and delayed
    messages due without sleeping; long polls parked on the broker re-check when it moves.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = time.time() if start is None else start.timestamp()
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
