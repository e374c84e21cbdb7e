"""SIGTERM/SIGINT → graceful stop, installed by ``run()`` only in the main thread.

The handler only records the signal: setting events or taking locks inside a signal
handler can deadlock with the very thread it interrupted. ``run()`` polls the flag.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalFlag:
    def __init__(self) -> None:
        self.received: int | None = None
        self.active = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum


@contextmanager
def stop_on_signals(enabled: bool) -> Iterator[SignalFlag]:
    """Install the flag as SIGTERM/SIGINT handler when enabled and in the main thread;
    the previous handlers come back afterwards."""
    flag = SignalFlag()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous: dict[int, Any] = {sig: signal.signal(sig, flag) for sig in STOP_SIGNALS}
    flag.active = True
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
