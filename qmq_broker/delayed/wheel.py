"""The in-memory timing wheel: due messages of the loaded hours in 500 ms slots.

Slots are keyed by tick number (``deliver_at_us // tick_us``) and hold packed
``(deliver_at_us, offset, length)`` triples, 24 bytes an entry. A slot is opened when the
clock reaches its tick: its entries move to a small heap ordered by exact due time (then
by schedule offset, i.e. acceptance order), from which due entries are popped. So a
message goes out at its own due time, not at the end of its tick, and in due order.

Pure data structure: the clock is passed in.
"""

from __future__ import annotations

import heapq
from array import array
from typing import NamedTuple

DEFAULT_TICK_US = 500_000


class WheelEntry(NamedTuple):
    """A scheduled record: its due time and where it lives in its hour's schedule segment."""

    deliver_at_us: int
    offset: int
    length: int


class TimingWheel:
    """Due-time ordered entries in sparse tick slots; ``pop_due`` hands out what is due."""

    __slots__ = ("_len", "_opened_through", "_ready", "_slots", "_ticks", "tick_us")

    def __init__(self, *, tick_us: int = DEFAULT_TICK_US) -> None:
        if tick_us <= 0:
            raise ValueError("tick_us must be positive")
        self.tick_us = tick_us
        self._slots: dict[int, array[int]] = {}
        self._ticks: list[int] = []  # heap of ticks that have a slot
        self._ready: list[WheelEntry] = []  # heap of entries of opened ticks
        self._opened_through = -1
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, deliver_at_us: int, offset: int, length: int) -> None:
        tick = deliver_at_us // self.tick_us
        self._len += 1
        if tick <= self._opened_through:
            heapq.heappush(self._ready, WheelEntry(deliver_at_us, offset, length))
            return
        slot = self._slots.get(tick)
        if slot is None:
            slot = self._slots[tick] = array("q")
            heapq.heappush(self._ticks, tick)
        slot.extend((deliver_at_us, offset, length))

    def _open_until(self, tick: int) -> None:
        opened: list[WheelEntry] = []
        while self._ticks and self._ticks[0] <= tick:
            slot = self._slots.pop(heapq.heappop(self._ticks))
            opened.extend(
                map(WheelEntry._make, zip(slot[0::3], slot[1::3], slot[2::3], strict=True))
            )
        if opened:
            self._ready.extend(opened)
            heapq.heapify(self._ready)
        self._opened_through = max(self._opened_through, tick)

    def pop_due(self, now_us: int, *, limit: int) -> list[WheelEntry]:
        """Up to ``limit`` entries due at ``now_us``, earliest first."""
        self._open_until(now_us // self.tick_us)
        out: list[WheelEntry] = []
        ready = self._ready
        while ready and ready[0].deliver_at_us <= now_us and len(out) < limit:
            out.append(heapq.heappop(ready))
        self._len -= len(out)
        return out

    def next_wakeup_us(self) -> int | None:
        """When to look again: the earliest opened entry's due time or the next slot's start."""
        candidates = []
        if self._ready:
            candidates.append(self._ready[0].deliver_at_us)
        if self._ticks:
            candidates.append(self._ticks[0] * self.tick_us)
        return min(candidates) if candidates else None

    def next_due_us(self) -> int | None:
        """The exact earliest due time held (scans one slot; for stats, not the hot loop)."""
        candidates = []
        if self._ready:
            candidates.append(self._ready[0].deliver_at_us)
        if self._ticks:
            slot = self._slots[self._ticks[0]]
            candidates.append(min(slot[0::3]))
        return min(candidates) if candidates else None
