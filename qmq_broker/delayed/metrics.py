"""Prometheus metrics of the scheduler (``qmq_broker_schedule_*``), on the broker's registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from qmq_broker.metrics import MetricFactory, ScrapedGauges

_LATENESS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.6, 1, 2.5, 5, 30, 300)

Snapshot = Callable[[], dict[str, Any]]


class ScheduleMetrics:
    """Counters and histograms updated by the scheduler; gauges read at scrape time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        declare = MetricFactory(registry, subsystem="broker_schedule")
        self.scheduled = declare.counter(
            "scheduled_messages", "Delayed messages accepted into the schedule log"
        )
        self.dispatched = declare.counter(
            "dispatched_messages", "Delayed messages appended to their subject when due"
        )
        self.redispatched = declare.counter(
            "redispatched_messages",
            "Dispatches after a restart that found the message already stored (not stored again)",
        )
        self.moved = declare.counter(
            "moved_messages", "Delayed messages moved from a day or 32-day bucket into a finer one"
        )
        self.unreadable = declare.counter(
            "unreadable_messages",
            "Delayed messages lost to damaged schedule files (found by recovery or at dispatch)",
        )
        self.unreadable_dispatches = declare.counter(
            "unreadable_dispatch_records",
            "Damaged dispatch records found by recovery (their messages go out again)",
        )
        self.lateness = declare.histogram(
            "dispatch_lateness_seconds",
            "Stored time minus due time of dispatched messages",
            buckets=_LATENESS_BUCKETS,
        )
        self.load_seconds = declare.histogram(
            "load_seconds",
            "Time to read one hour's schedule segment into the timing wheel",
            buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 30),
        )
        self._registry = registry

    def watch(self, snapshot: Snapshot) -> None:
        """Expose pending counts, wheel size and next due time from ``snapshot()``."""
        self._registry.register(_ScheduleCollector(snapshot))


class _ScheduleCollector(ScrapedGauges):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def gauges(self) -> list[tuple[str, str, float]]:
        doc = self._snapshot()
        gauges = [
            ("pending_messages", "Delayed messages not yet due", doc["messages"]),
            ("pending_bytes", "Bytes of delayed messages not yet due", doc["bytes"]),
            ("buckets", "Hours with pending delayed messages", doc["hours"]),
            ("wheel_messages", "Delayed messages held in the in-memory wheel", doc["wheel"]),
            ("id_set_bytes", "Memory of the scheduled-id dedup set", doc["id_set_bytes"]),
            (
                "next_due_timestamp_seconds",
                "Due time of the earliest pending message (0: none)",
                doc["next_due_us"] / 1e6 if doc["next_due_us"] is not None else 0.0,
            ),
            (
                "dispatch_lag_seconds",
                "How long the earliest pending message is overdue (0: none overdue)",
                doc["lag_us"] / 1e6,
            ),
        ]
        return [(f"qmq_broker_schedule_{name}", text, value) for name, text, value in gauges]
