"""A bounded, in-memory history: one value per series per sample, for the last ``capacity``
samples (an hour of 10 s samples by default). Pure: the sampler supplies time and values.

Memory is fixed per series (an ``array('d')`` of ``capacity`` doubles) and the number of
series is capped: a series absent from a whole window is dropped, and a new series beyond
the cap is not tracked (counted in ``untracked``) until one leaves.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Hashable, Mapping

MISSING = math.nan
"""Stored for a series that had no value at a sample (a group that did not exist yet)."""


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class History:
    """Samples of many series on one shared time axis, the newest ``capacity`` of them."""

    capacity: int
    max_series: int
    untracked: int = dataclasses.field(init=False, default=0)
    """Series refused at the latest sample because ``max_series`` were tracked."""
    _times: array[float] = dataclasses.field(init=False)  # wall time of each slot, seconds
    _series: dict[Hashable, array[float]] = dataclasses.field(init=False, default_factory=dict)
    _recorded: int = dataclasses.field(init=False, default=0)
    """Samples ever recorded; the next one goes to slot ``_recorded % capacity``."""

    def __post_init__(self) -> None:
        if self.capacity < 2 or self.max_series < 1:
            raise ValueError("capacity must be >= 2 and max_series >= 1")
        self._times = array("d", [MISSING] * self.capacity)

    def __len__(self) -> int:
        """Samples held (up to ``capacity``)."""
        return min(self._recorded, self.capacity)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._series

    @property
    def series_count(self) -> int:
        return len(self._series)

    def record(self, at: float, values: Mapping[Hashable, float]) -> None:
        """One sample at wall time ``at`` (seconds): each series' value, absent ones missing."""
        slot = self._recorded % self.capacity
        self._recorded += 1
        self._times[slot] = at
        absent: list[Hashable] = []
        for key, ring in self._series.items():
            value = values.get(key)
            if value is None:
                ring[slot] = MISSING
                absent.append(key)
            else:
                ring[slot] = float(value)
        for key in absent:  # gone for a whole window: forget it
            if all(math.isnan(v) for v in self._series[key]):
                del self._series[key]
        untracked = 0
        for key, value in values.items():
            if key in self._series:
                continue
            if len(self._series) >= self.max_series:
                untracked += 1
                continue
            ring = array("d", [MISSING] * self.capacity)
            ring[slot] = float(value)
            self._series[key] = ring
        self.untracked = untracked

    def times(self) -> list[float]:
        """The held samples' wall times, oldest first."""
        return self._ordered(self._times)

    def values(self, key: Hashable) -> list[float | None]:
        """A series' values at ``times()``, oldest first; None where it had none."""
        ring = self._series.get(key)
        if ring is None:
            return [None] * len(self)
        return [None if math.isnan(v) else v for v in self._ordered(ring)]

    def latest(self, key: Hashable) -> float | None:
        """A series' value at the newest sample, None when it had none."""
        ring = self._series.get(key)
        if ring is None or not self._recorded:
            return None
        value = ring[(self._recorded - 1) % self.capacity]
        return None if math.isnan(value) else value

    def _ordered(self, ring: array[float]) -> list[float]:
        held = len(self)
        start = (self._recorded - held) % self.capacity
        return [ring[(start + i) % self.capacity] for i in range(held)]
