"""UUIDv7 message ids (RFC 9562): time-ordered, so ids sort by creation time."""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_COUNTER_MAX = 0xFFF


def _next_timestamp_and_counter() -> tuple[int, int]:
    """Milliseconds since the epoch plus a 12-bit counter, monotonic within this process."""
    global _last_ms, _counter
    now_ms = time.time_ns() // 1_000_000
    with _lock:
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = int.from_bytes(os.urandom(2), "big") & 0x7FF  # room to count up
        else:
            _counter += 1
            if _counter > _COUNTER_MAX:  # 2048+ ids in one millisecond: borrow the next one
                _last_ms += 1
                _counter = 0
        return _last_ms, _counter


def uuid7() -> uuid.UUID:
    """A new UUIDv7; ids made by one process are strictly increasing."""
    unix_ms, counter = _next_timestamp_and_counter()
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (unix_ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= counter << 64  # rand_a used as a counter (RFC 9562 §6.2 method 1)
    value |= 0b10 << 62  # variant
    value |= rand_b
    return uuid.UUID(int=value)


def uuid7_str() -> str:
    """``str(uuid7())``: the SDK's default message id."""
    return str(uuid7())
