"""The compensator's Prometheus metrics, on a registry of their own (``qmq_compensator_*``)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class CompensatorMetrics:
    """Gauges of the outbox's backlog and counters/histograms of the compensator's work."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        gauge = functools.partial(Gauge, registry=self.registry)
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.pending = gauge("qmq_compensator_pending_messages", "Outbox rows still pending.")
        self.oldest_pending_age = gauge(
            "qmq_compensator_oldest_pending_age_seconds",
            "Age of the oldest pending outbox row (0 when none).",
        )
        self.sent = counter(
            "qmq_compensator_sent_messages",
            "Rows the compensator got stored in the broker and marked sent.",
        )
        self.resent = counter(
            "qmq_compensator_resent_messages",
            "Of those, rows the broker already had (answered duplicate): true resends.",
        )
        self.retried = counter(
            "qmq_compensator_failed_attempts",
            "Send attempts that failed transiently and were scheduled again.",
        )
        self.dead = counter(
            "qmq_compensator_dead_messages",
            "Rows given up on (rejected by the broker or out of attempts).",
        )
        self.lost_claims = counter(
            "qmq_compensator_lost_claims",
            "Sent rows this compensator could not mark: its claim had been taken over.",
        )
        self.purged = counter(
            "qmq_compensator_purged_messages", "Sent rows deleted after the retention period."
        )
        self.claim_latency = histogram(
            "qmq_compensator_claim_duration_seconds", "Time to claim one batch of due rows."
        )
        self.send_latency = histogram(
            "qmq_compensator_send_duration_seconds",
            "Time to produce one claimed batch to the broker.",
        )
