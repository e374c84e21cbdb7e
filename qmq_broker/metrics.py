"""Prometheus metrics of one broker, on its own registry (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

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


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.produced = Counter("qmq_broker_produced_messages", "Messages stored", registry=r)
        self.pulled = Counter(
            "qmq_broker_pulled_messages", "Messages delivered to consumers", registry=r
        )
        self.acked = Counter("qmq_broker_acked_messages", "Messages acknowledged", registry=r)
        self.filtered = Counter(
            "qmq_broker_filtered_messages",
            "Messages a group's tag filter skipped: never leased, never acked",
            registry=r,
        )
        self.nacked = Counter(
            "qmq_broker_nacked_messages", "Messages negatively acknowledged", registry=r
        )
        self.unreadable = Counter(
            "qmq_broker_unreadable_messages",
            "Messages dead-lettered because their stored record could not be read",
            registry=r,
        )
        self.recovery_problems = Gauge(
            "qmq_broker_recovery_problems",
            "Damage the last recovery found and repaired or served around (see the log)",
            registry=r,
        )
        self.requests = Histogram(
            "qmq_broker_request_seconds",
            "Request latency by endpoint",
            ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.fsync_seconds = Histogram(
            "qmq_broker_fsync_seconds",
            "Latency of one group-commit fsync",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "qmq_broker_checkpoint_seconds",
            "Time to write one checkpoint",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.connections_open = Gauge(
            "qmq_broker_connections_open", "Client connections open now", registry=r
        )
        self.connections_refused = Counter(
            "qmq_broker_connections_refused",
            "Connections answered 503 too_many_connections and closed: --max-connections open",
            registry=r,
        )
        self.connections_timed_out = Counter(
            "qmq_broker_connections_timed_out",
            "Connections the broker closed: 'header' (no complete request head within "
            "--header-timeout) or 'idle' (nothing sent for --idle-timeout after a response)",
            ["reason"],
            registry=r,
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
        values = {
            "qmq_broker_index_memory_bytes": (
                "Index entries held in memory (the newest chunk of each subject)",
                subjects.memory_bytes(),
            ),
            "qmq_broker_index_open_chunk_files": (
                "Sealed index chunk files open for reads",
                subjects.reader.open_files,
            ),
            "qmq_broker_dedup_recent_ids": (
                "Ids in the dedup stores' in-memory dicts, not yet in a run",
                sum(s.recent_ids for s in stats),
            ),
            "qmq_broker_dedup_run_ids": (
                "Ids in the dedup stores' run files",
                sum(s.run_ids for s in stats),
            ),
            "qmq_broker_dedup_run_bytes": (
                "Bytes of the dedup stores' run files (on disk, mapped)",
                sum(s.run_bytes for s in stats),
            ),
            "qmq_broker_dedup_filter_bytes": (
                "Bytes of the dedup stores' filters (in memory)",
                sum(s.filter_bytes for s in stats),
            ),
            "qmq_broker_dedup_filter_false_positive_ratio": (
                "Filter lookups that said maybe and no run held the id, of all lookups",
                false_positives / lookups if lookups else 0.0,
            ),
        }
        return [(name, documentation, value) for name, (documentation, value) in values.items()]
