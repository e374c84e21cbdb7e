"""The compensator's Prometheus metrics, on a registry of their own (``qmq_compensator_*``).

The backlog gauges (pending rows, the oldest pending row's age, dead rows) are set from one
aggregate query per pass (``OutboxStore.backlog``): totals, and per subject for the
``MAX_SUBJECTS`` subjects with the most rows waiting. Every compensator of a table reports
the same table, so aggregate them across instances with ``max``, not ``sum``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from qmq_outbox.store import SubjectBacklog

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_SUBJECTS = 100  # bounds the per-subject series; the totals count every subject


class CompensatorMetrics:
    """Gauges of the outbox's backlog and counters/histograms of the compensator's work."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # Each metric is named qmq_compensator_<name>, on this registry.
        r, subsystem = self.registry, "compensator"
        gauge = functools.partial(Gauge, namespace="qmq", subsystem=subsystem, registry=r)
        counter = functools.partial(Counter, namespace="qmq", subsystem=subsystem, registry=r)
        histogram = functools.partial(
            Histogram, namespace="qmq", subsystem=subsystem, registry=r, buckets=_LATENCY_BUCKETS
        )
        self.pending = gauge("pending_messages", "Outbox rows still pending.")
        self.oldest_pending_age = gauge(
            "oldest_pending_age_seconds", "Age of the oldest pending outbox row (0 when none)."
        )
        self.dead_rows = gauge("dead_rows", "Outbox rows dead now, whoever marked them.")
        self.sent = counter(
            "sent_messages", "Rows the compensator got stored in the broker and marked sent."
        )
        self.resent = counter(
            "resent_messages",
            "Of those, rows the broker already had (answered duplicate): true resends.",
        )
        self.retried = counter(
            "failed_attempts", "Send attempts that failed transiently and were scheduled again."
        )
        self.dead = counter(
            "dead_messages",
            "Rows that went dead: marked by this compensator, or by a dispatcher (seen as "
            "the table's dead rows growing between passes).",
        )
        self.lost_claims = counter(
            "lost_claims",
            "Sent rows this compensator could not mark: its claim had been taken over.",
        )
        self.purged = counter("purged_messages", "Sent rows deleted after the retention period.")
        self.claim_latency = histogram(
            "claim_duration_seconds", "Time to claim one batch of due rows."
        )
        self.send_latency = histogram(
            "send_duration_seconds", "Time to produce one claimed batch to the broker."
        )
        self.by_subject = SubjectGauges()
        self.registry.register(self.by_subject)
        self._dead_seen: int | None = None  # the table's dead rows at the last refresh
        self._dead_counted = 0.0  # self.dead's value then

    def refresh(self, backlog: Sequence[SubjectBacklog], now: datetime) -> None:
        """Set the gauges from one ``OutboxStore.backlog`` read at ``now``, and count the
        rows that went dead since the last refresh without this compensator marking them
        (a dispatcher's rejections)."""
        oldest = [s.oldest_pending_at for s in backlog if s.oldest_pending_at is not None]
        self.pending.set(sum(s.pending for s in backlog))
        self.oldest_pending_age.set(_age(min(oldest), now) if oldest else 0.0)
        dead = sum(s.dead for s in backlog)
        self.dead_rows.set(dead)
        counted = _value(self.dead)
        if self._dead_seen is not None:
            # Growth it did not mark itself; a retry in between only hides some of it.
            elsewhere = (dead - self._dead_seen) - (counted - self._dead_counted)
            if elsewhere > 0:
                self.dead.inc(elsewhere)
                counted += elsewhere
        self._dead_seen, self._dead_counted = dead, counted
        self.by_subject.set(backlog, now)


class SubjectGauges(Collector):
    """The backlog gauges per subject (label ``subject``), from the last refresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: list[tuple[str, int, float, int]] = []

    def set(self, backlog: Sequence[SubjectBacklog], now: datetime) -> None:
        busiest = sorted(backlog, key=lambda s: (-(s.pending + s.dead), s.subject))
        rows = [
            (s.subject, s.pending, _age(s.oldest_pending_at, now), s.dead)
            for s in busiest[:MAX_SUBJECTS]
        ]
        with self._lock:
            self._rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            rows = self._rows
        families = (
            ("qmq_compensator_subject_pending_messages", "Pending rows of the subject.", 1),
            (
                "qmq_compensator_subject_oldest_pending_age_seconds",
                "Age of the subject's oldest pending row (0 when none).",
                2,
            ),
            ("qmq_compensator_subject_dead_rows", "Dead rows of the subject.", 3),
        )
        for name, documentation, column in families:
            family = GaugeMetricFamily(name, documentation, labels=["subject"])
            for row in rows:
                family.add_metric([row[0]], float(row[column]))
            yield family


def _age(created_at: datetime | None, now: datetime) -> float:
    if created_at is None:
        return 0.0
    return max(0.0, (now - created_at).total_seconds())


def _value(counter: Counter) -> float:
    """A counter's current total, read through its public ``collect``."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                return float(sample.value)
    return 0.0
