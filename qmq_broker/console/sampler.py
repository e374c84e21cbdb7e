"""The console's sampler: every ``interval_s`` it notes each subject's rates in and out and
each group's backlog into a ``History``, and the broker-wide disk use and fsync latency.

Run as the supervised loop ``qmq-console-sampler``. Counters come from what the broker
keeps anyway: a subject's ``next_seq`` (messages stored), its groups' ``acked`` counts and
backlogs, and the fsync histogram of ``/metrics``. Rates are per second over the interval
between two samples, so they appear from the second sample on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Hashable
from pathlib import Path

from prometheus_client import Histogram

from qmq_broker.clock import Clock
from qmq_broker.console.disk import DiskUse, disk_use
from qmq_broker.console.history import History
from qmq_broker.errors import NotFound, Unavailable
from qmq_broker.stats import StatsService

logger = logging.getLogger(__name__)
MIN_INTERVAL_S = 0.1  # a shorter --console-sample-interval is taken as this


def in_key(subject: str) -> tuple[str, str]:
    """History key of a subject's messages stored per second."""
    return ("in", subject)


def out_key(subject: str, group: str) -> tuple[str, str, str]:
    """History key of a group's messages acked per second (a subject's out: its groups'
    sum, over the groups a caller may see)."""
    return ("out", subject, group)


def backlog_key(subject: str, group: str) -> tuple[str, str, str]:
    """History key of a group's backlog (messages not yet delivered to it)."""
    return ("backlog", subject, group)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FsyncWindow:
    """The group-commit fsyncs of the last sample interval."""

    fsyncs: int
    mean_ms: float | None
    p99_ms: float | None
    """The upper bound of the histogram bucket the 99th percentile fell in."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Latest:
    """What the newest sample saw besides the history's series."""

    at: float
    """Wall time, seconds since the epoch."""
    disk: DiskUse | None
    fsync: FsyncWindow


_NO_FSYNC = FsyncWindow(fsyncs=0, mean_ms=None, p99_ms=None)


class ConsoleSampler:
    def __init__(
        self,
        *,
        stats: StatsService,
        fsync_seconds: Histogram,
        data_dir: Path,
        clock: Clock,
        history: History,
        interval_s: float,
    ) -> None:
        self.history = history
        self.interval_s = max(interval_s, MIN_INTERVAL_S)
        self.latest: Latest | None = None
        self._stats = stats
        self._fsync_seconds = fsync_seconds
        self._data_dir = data_dir
        self._clock = clock
        self._last_at: float | None = None  # monotonic time of the previous sample
        self._stored: dict[str, int] = {}
        self._acked: dict[tuple[str, str], int] = {}
        self._fsync_buckets: dict[float, float] = {}
        self._fsync_sum = 0.0

    async def run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)

    async def sample(self) -> None:
        """Take one sample. A broker that is stopping or not yet ready is skipped."""
        try:
            values = self._counters()
        except Unavailable:
            return
        at = self._clock.wall_us() / 1_000_000
        self.history.record(at, values)
        fsync = self._fsync_window()
        try:
            disk: DiskUse | None = await asyncio.to_thread(disk_use, self._data_dir)
        except OSError:
            logger.warning(
                "disk use not measured", extra={"action": "console.disk_failed"}, exc_info=True
            )
            disk = None
        self.latest = Latest(at=at, disk=disk, fsync=fsync)

    def _counters(self) -> dict[Hashable, float]:
        """Rates since the previous sample and backlogs now (on the loop: one consistent
        view of the broker's state)."""
        now = self._clock.now()
        elapsed = None if self._last_at is None else now - self._last_at
        values: dict[Hashable, float] = {}
        stored: dict[str, int] = {}
        acked: dict[tuple[str, str], int] = {}
        for summary in self._stats.subjects():
            subject = summary.subject
            stored[subject] = summary.next_seq
            try:
                detail = self._stats.subject(subject)
            except NotFound:  # listed but not servable (declared, nothing kept): no groups
                continue
            # A subject or group new since the previous sample started from nothing.
            for group in detail.groups:
                key = (subject, group.group)
                acked[key] = group.acked
                values[backlog_key(*key)] = group.backlog
                if elapsed:
                    values[out_key(*key)] = max(group.acked - self._acked.get(key, 0), 0) / elapsed
            if elapsed:
                stored_now = summary.next_seq - self._stored.get(subject, 0)
                values[in_key(subject)] = max(stored_now, 0) / elapsed
        self._last_at, self._stored, self._acked = now, stored, acked
        return values

    def _fsync_window(self) -> FsyncWindow:
        """The fsync histogram's change since the previous sample."""
        buckets: dict[float, float] = {}
        total = 0.0
        for metric in self._fsync_seconds.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
        before, self._fsync_buckets = self._fsync_buckets, buckets
        spent, self._fsync_sum = total - self._fsync_sum, total
        if not before:
            return _NO_FSYNC
        bounds = sorted(buckets)
        counts = [buckets[b] - before.get(b, 0.0) for b in bounds]  # cumulative per bound
        count = int(counts[-1]) if counts else 0
        if count <= 0:
            return _NO_FSYNC
        p99 = next(b for b, c in zip(bounds, counts, strict=True) if c >= 0.99 * count)
        return FsyncWindow(
            fsyncs=count,
            mean_ms=spent / count * 1000,
            p99_ms=None if math.isinf(p99) else p99 * 1000,
        )
