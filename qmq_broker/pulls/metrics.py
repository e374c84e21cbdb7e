"""Prometheus series per actor (labels ``subject``, ``group``), on the broker's registry.

What an actor counts on itself anyway (runs, service, work and suspended seconds) is read
from it at scrape time, with its mailbox depth, parked requests and virtual runtime: a run
then updates no series. The queue-wait histogram and the expired and rejected counters are
updated as things happen (each actor keeps its label children, so an update is one call).
Broker-wide totals (pending and parked pulls, pulls refused by the broker-wide cap) have no
labels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qmq_broker.metrics import MetricFactory

_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActorReading:
    """One actor's figures, read at scrape time."""

    subject: str
    group: str
    queued: int  # pulls in its mailbox
    parked: int  # long polls parked
    vruntime: float  # seconds
    runs: int
    service_s: float
    work_s: float
    suspended_s: float


ActorGauges = Callable[[], Iterable[ActorReading]]
# (pending, parked) over all actors
PullTotals = Callable[[], tuple[int, int]]


@dataclasses.dataclass(frozen=True, slots=True)
class ActorSeries:
    """The label children of one actor."""

    queue_wait: Histogram
    expired: Counter
    rejected: Counter


class ActorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["subject", "group"]
        declare = MetricFactory(registry, subsystem="broker")
        self.queue_wait = declare.histogram(
            "actor_queue_wait_seconds",
            "Time a pull waited in its actor's mailbox before a worker took it",
            labels,
            buckets=_WAIT_BUCKETS,
        )
        self.expired = declare.counter(
            "actor_expired_requests",
            "Pulls answered 503 deadline_exceeded after waiting past their deadline",
            labels,
        )
        self.rejected = declare.counter(
            "actor_rejected_requests", "Pulls answered 429 mailbox_full", labels
        )
        self.pulls_refused = declare.counter(
            "pulls_refused",
            "Pulls answered 429 too_many_pulls: the broker had --max-pending-pulls pending",
        )
        self._pending = declare.gauge(
            "pulls_pending", "Pulls not answered yet, all groups: queued, being served or parked"
        )
        self._parked = declare.gauge(
            "pulls_parked", "Long polls parked until data or their timeout, all groups"
        )
        self._registry = registry

    def series(self, subject: str, group: str) -> ActorSeries:
        return ActorSeries(
            queue_wait=self.queue_wait.labels(subject, group),
            expired=self.expired.labels(subject, group),
            rejected=self.rejected.labels(subject, group),
        )

    def watch(self, gauges: ActorGauges) -> None:
        """Expose each actor's ``ActorReading`` at scrape time."""
        self._registry.register(_ActorCollector(gauges))

    def watch_totals(self, totals: PullTotals) -> None:
        """Expose the broker-wide pending and parked pulls at scrape time."""
        self._pending.set_function(lambda: totals()[0])
        self._parked.set_function(lambda: totals()[1])


class _ActorCollector(Collector):
    def __init__(self, gauges: ActorGauges) -> None:
        self._gauges = gauges

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["subject", "group"]
        runs = CounterMetricFamily(
            "qmq_broker_actor_runs", "Slices an actor ran on a worker", labels=labels
        )
        service = CounterMetricFamily(
            "qmq_broker_actor_service_seconds",
            "Wall time an actor spent running, waits for reads included",
            labels=labels,
        )
        work = CounterMetricFamily(
            "qmq_broker_actor_work_seconds",
            "CPU an actor's pulls cost in its runs, on the loop and the read thread (with "
            "the work charged outside them, its virtual runtime)",
            labels=labels,
        )
        suspended = CounterMetricFamily(
            "qmq_broker_actor_suspended_seconds",
            "Time an actor spent suspended: only long polls parked, no worker used",
            labels=labels,
        )
        mailbox = GaugeMetricFamily(
            "qmq_broker_actor_mailbox_requests",
            "Pulls queued in an actor's mailbox, waiting for a worker",
            labels=labels,
        )
        parked = GaugeMetricFamily(
            "qmq_broker_actor_parked_requests",
            "Long polls parked by an actor until data or their timeout",
            labels=labels,
        )
        vruntime = GaugeMetricFamily(
            "qmq_broker_actor_vruntime_seconds",
            "An actor's virtual runtime (fair scheduler priority; lower runs first)",
            labels=labels,
        )
        for actor in self._gauges():
            names = [actor.subject, actor.group]
            runs.add_metric(names, float(actor.runs))
            service.add_metric(names, actor.service_s)
            work.add_metric(names, actor.work_s)
            suspended.add_metric(names, actor.suspended_s)
            mailbox.add_metric(names, float(actor.queued))
            parked.add_metric(names, float(actor.parked))
            vruntime.add_metric(names, actor.vruntime)
        yield from (runs, service, work, suspended, mailbox, parked, vruntime)

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())
