"""SIGTERM/SIGINT → graceful stop, installed on the consumer's loop only in the main thread.

``loop.add_signal_handler`` runs the callback on the loop, not inside the signal handler
(where setting events or taking locks could deadlock with the interrupted code). The
previous handlers come back afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_on_signals(
    loop: asyncio.AbstractEventLoop, enabled: bool, on_signal: Callable[[int], None]
) -> Iterator[None]:
    """Call ``on_signal(signum)`` on ``loop`` for SIGTERM/SIGINT while inside, when enabled
    and in the main thread."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, int(sig))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
