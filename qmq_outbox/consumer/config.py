"""The consumer's settings and its counters."""

from __future__ import annotations

import dataclasses
import hashlib
import threading

from qmq_outbox.calls import Position, PullMode


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerConfig:
    group: str
    consumer_id: str
    concurrency: int
    prefetch: int
    max_batch: int
    wait_ms: int
    ack_batch_size: int
    ack_interval: float
    mode: PullMode
    start: Position
    shutdown_timeout: float
    outage_summary: float = 60.0  # seconds between the log's summaries of a broker outage
    ordered_keys: int | None = None  # an ordered partition's keys in flight; None: 2 x concurrency

    @property
    def capacity(self) -> int:
        """The most leases held at once: running plus prefetched."""
        return self.concurrency + self.prefetch

    @property
    def store_group(self) -> str:
        """The ``consumer_group`` of this consumer's ``qmq_consumed`` rows.

        Shared mode: the group (its consumers share the messages, so they share the dedup
        rows). Broadcast mode: every consumer must handle every message, so each dedups on
        its own: ``group@consumer_id`` (hashed to fit the 200-character column).
        """
        if self.mode == "shared":
            return self.group
        key = f"{self.group}@{self.consumer_id}"
        if len(key) <= 200:
            return key
        digest = hashlib.sha256(self.consumer_id.encode()).hexdigest()[:32]
        return f"{self.group[:160]}@{digest}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerStats:
    """A snapshot of a consumer's counters since it was created."""

    pulled: int
    processed: int
    duplicates: int
    nacked: int
    acked: int
    ack_unknown: int
    filtered: int = 0
    """Acked unrun: not of the handler's tags (a transport that cannot filter sent them)."""

    @property
    def in_flight(self) -> int:
        """Pulled and not yet finished (running, queued, or abandoned at a stop timeout)."""
        return self.pulled - self.processed - self.duplicates - self.nacked - self.filtered


class Counters:
    """Thread-safe counters behind ``Consumer.stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(
            ("pulled", "processed", "duplicates", "nacked", "acked", "ack_unknown", "filtered"), 0
        )

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self._values[name] += count

    def snapshot(self) -> ConsumerStats:
        with self._lock:
            return ConsumerStats(**self._values)
