"""Prometheus metrics of one broker, on its own registry (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from qmq_broker.groups import GroupStats
from qmq_broker.subjects import SubjectTable

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)

GroupStatsSource = Callable[[], Iterable[tuple[str, str, GroupStats]]]


class MetricFactory:
    """Declares counters, gauges and histograms named ``qmq_<subsystem>_<name>`` on one
    registry, so that a declaration says only what differs: name, help text, labels,
    buckets."""

    def __init__(self, registry: CollectorRegistry, *, subsystem: str) -> None:
        self._registry = registry
        self._subsystem = subsystem

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, documentation, labels, **self._placing())

    def gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, **self._placing())

    def histogram(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, **self._placing())

    def _placing(self) -> dict[str, Any]:
        return {"namespace": "qmq", "subsystem": self._subsystem, "registry": self._registry}


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        declare = MetricFactory(self.registry, subsystem="broker")
        self.produced = declare.counter("produced_messages", "Messages stored")
        self.pulled = declare.counter("pulled_messages", "Messages delivered to consumers")
        self.acked = declare.counter("acked_messages", "Messages acknowledged")
        self.filtered = declare.counter(
            "filtered_messages", "Messages a group's tag filter skipped: never leased, never acked"
        )
        self.nacked = declare.counter("nacked_messages", "Messages negatively acknowledged")
        self.unreadable = declare.counter(
            "unreadable_messages",
            "Messages dead-lettered because their stored record could not be read",
        )
        self.recovery_problems = declare.gauge(
            "recovery_problems",
            "Damage the last recovery found and repaired or served around (see the log)",
        )
        self.requests = declare.histogram(
            "request_seconds",
            "Request latency by endpoint",
            ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS,
        )
        self.fsync_seconds = declare.histogram(
            "fsync_seconds", "Latency of one group-commit fsync", buckets=_LATENCY_BUCKETS
        )
        self.checkpoint_seconds = declare.histogram(
            "checkpoint_seconds", "Time to write one checkpoint", buckets=_LATENCY_BUCKETS
        )
        self.connections_open = declare.gauge("connections_open", "Client connections open now")
        self.connections_refused = declare.counter(
            "connections_refused",
            "Connections answered 503 too_many_connections and closed: --max-connections open",
        )
        self.connections_timed_out = declare.counter(
            "connections_timed_out",
            "Connections the broker closed: 'header' (no complete request head within "
            "--header-timeout) or 'idle' (nothing sent for --idle-timeout after a response)",
            ["reason"],
        )

    def watch_storage(self, subjects: SubjectTable) -> None:
        """Expose what the index and the dedup stores hold in memory, at scrape time."""
        self.registry.register(_StorageCollector(subjects))

    def watch_groups(self, stats: GroupStatsSource) -> None:
        """Expose backlog, in-flight, retrying, dead and filtered counts per group at scrape
        time."""
        self.registry.register(_GroupCollector(stats))


class _GroupCollector(Collector):
    def __init__(self, stats: GroupStatsSource) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            name: GaugeMetricFamily(
                f"qmq_broker_group_{name}_messages",
                f"Messages {name} per group",
                labels=["subject", "group"],
            )
            for name in ("backlog", "in_flight", "retrying", "dead", "filtered")
        }
        for subject, group, stats in self._stats():
            for name, family in families.items():
                family.add_metric([subject, group], float(getattr(stats, name)))
        yield from families.values()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class ScrapedGauges(Collector):
    """Gauges without labels, read at scrape time: ``gauges()`` gives each one's name, help
    text and value."""

    def gauges(self) -> Iterable[tuple[str, str, float]]:
        raise NotImplementedError

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, value in self.gauges():
            family = GaugeMetricFamily(name, documentation)
            family.add_metric([], float(value))
            yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class _StorageCollector(ScrapedGauges):
    """Memory the subjects' indexes and dedup stores hold, summed over subjects."""

    def __init__(self, subjects: SubjectTable) -> None:
        self._subjects = subjects

    def gauges(self) -> list[tuple[str, str, float]]:
        subjects = self._subjects
        logs = list(subjects.values())  # a snapshot: scrapes may run off the event loop
        stats = [s for s in (log.dedup_stats() for log in logs) if s is not None]
        lookups = sum(s.filter_lookups for s in stats)
        false_positives = sum(s.filter_false_positives for s in stats)
        ratio = false_positives / lookups if lookups else 0.0
        return [
            ("qmq_broker_index_memory_bytes", _INDEX_MEMORY, subjects.memory_bytes()),
            ("qmq_broker_index_open_chunk_files", _OPEN_CHUNKS, subjects.reader.open_files),
            ("qmq_broker_dedup_filter_false_positive_ratio", _FALSE_POSITIVES, ratio),
            *(
                (name, documentation, sum(getattr(s, field) for s in stats))
                for name, field, documentation in _DEDUP_SUMS
            ),
        ]


_INDEX_MEMORY = "Index entries held in memory (the newest chunk of each subject)"
_OPEN_CHUNKS = "Sealed index chunk files open for reads"
_FALSE_POSITIVES = "Filter lookups that said maybe and no run held the id, of all lookups"
# Gauges summed over the subjects' dedup stores: name, the field of ``DedupStats``, help.
_DEDUP_SUMS = (
    (
        "qmq_broker_dedup_recent_ids",
        "recent_ids",
        "Ids in the dedup stores' in-memory dicts, not yet in a run",
    ),
    ("qmq_broker_dedup_run_ids", "run_ids", "Ids in the dedup stores' run files"),
    (
        "qmq_broker_dedup_run_bytes",
        "run_bytes",
        "Bytes of the dedup stores' run files (on disk, mapped)",
    ),
    (
        "qmq_broker_dedup_filter_bytes",
        "filter_bytes",
        "Bytes of the dedup stores' filters (in memory)",
    ),
)
