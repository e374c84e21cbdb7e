"""The acker: one task that sends the buffered acks (``AckBuffer``) by size, by interval,
when hurried, and on close. A sent ack gives its lease slot back to its budget (the plain
subjects' or the ordered subjects', ``budget_of`` the ack's key). While the
broker is unavailable the acks wait, retried with a jittered backoff; the outage is logged
by the consumer's ``FailureLog`` (source ``ack``).

Acks are buffered under a key: the subject, or for an ordered subject's partition its log
name ``subject#p`` (``qmq_wire.partition_log``), so each partition's acks are a request of
their own that names it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from qmq_outbox.calls import AckedPull
from qmq_outbox.consumer.acks import AckBuffer, chunks
from qmq_outbox.consumer.budget import LeaseBudget
from qmq_outbox.consumer.clients import PullClient
from qmq_outbox.consumer.config import ConsumerConfig, Counters
from qmq_outbox.consumer.logs import (
    FINAL_ACK_ATTEMPTS,
    log_ack_failed,
    log_ack_unknown,
    log_dropped,
    retry_pause,
)
from qmq_outbox.errors import BrokerError, BrokerUnavailable
from qmq_outbox.failure_log import FailureLog
from qmq_wire.ordered import split_partition_log

SOURCE = "ack"  # the acker's name in the consumer's FailureLog

CLOSING_RETRY = 0.2  # seconds between the last attempts to send acks at a stop


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class Acker:
    """Lives on the consumer's loop: ``add``/``hurry``/``close`` are called from its tasks."""

    client: PullClient
    config: ConsumerConfig
    counters: Counters
    budget_of: Callable[[str], LeaseBudget]
    failures: FailureLog
    _buffer: AckBuffer = dataclasses.field(init=False)
    _wake: asyncio.Event = dataclasses.field(init=False, default_factory=asyncio.Event)
    _closed: bool = dataclasses.field(init=False, default=False)
    _retry_at: float = dataclasses.field(init=False, default=0.0)

    def __post_init__(self) -> None:
        config = self.config
        self._buffer = AckBuffer(max_size=config.ack_batch_size, interval=config.ack_interval)

    def add(self, key: str, seq: int) -> None:
        """Buffer the ack of ``seq`` of ``key`` (a subject, or ``subject#p``)."""
        first = len(self._buffer) == 0
        if self._buffer.add(key, seq, time.monotonic()) or first or self._buffer.urgent:
            self._wake.set()  # due now, or the interval's clock starts

    def hurry(self) -> None:
        self._buffer.hurry()
        self._wake.set()

    def idle(self) -> None:
        """A pull came back empty: nothing will join the buffered acks soon, send them."""
        self.send_now()

    def send_now(self) -> None:
        """Send what is buffered without waiting for the interval (nothing if nothing is)."""
        if len(self._buffer):
            self.hurry()

    def carry(self, subject: str) -> list[int]:
        """Buffered acks of ``subject`` for the next pull to carry (``ack_and_pull``): one
        request instead of a pull and an ack. Their lease slots pass to that pull, which
        gives them back (or keeps them for the messages it gets); if it fails, ``put_back``
        hands the acks back to the acker, slots included."""
        return self._buffer.take_subject(subject)

    def carried(self, subject: str, answer: AckedPull) -> None:
        """The broker answered the acks a pull carried."""
        self.failures.succeeded(source=SOURCE)
        self._record(subject, {"acked": answer.acked, "unknown": answer.unknown})

    def put_back(self, subject: str, seqs: list[int]) -> None:
        """The pull that carried ``seqs`` failed: the acker sends them itself."""
        self._buffer.put_back({subject: seqs}, time.monotonic())
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def run(self) -> None:
        failures = 0
        while True:
            closing = await self._wait_due()
            batch = self._buffer.take()
            if not batch:
                if closing:
                    return
                continue
            unsent = await self.send(batch)
            if not unsent:
                failures = 0
                continue
            failures += 1
            if closing and failures >= FINAL_ACK_ATTEMPTS:
                log_dropped(self.config, unsent)
                for key, seqs in unsent.items():
                    self.budget_of(key).release(len(seqs))
                return
            now = time.monotonic()
            self._buffer.put_back(unsent, now)
            self._retry_at = now + (CLOSING_RETRY if closing else retry_pause(failures))

    async def _wait_due(self) -> bool:
        """Wait until a flush is due; True once closed (then flush what is left)."""
        while True:
            now = time.monotonic()
            due = self._buffer.due_in(now)
            if self._closed:
                if due is not None and self._retry_at > now:
                    await asyncio.sleep(min(self._retry_at - now, CLOSING_RETRY))
                return True
            wait = None if due is None else max(due, self._retry_at - now)
            if wait is not None and wait <= 0:
                await asyncio.sleep(0)  # acks of handlers that just finished join this batch
                return False
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def send(self, batch: dict[str, list[int]]) -> dict[str, list[int]]:
        """Ack every key's seqs; returns what could not be sent (to retry)."""
        unsent: dict[str, list[int]] = {}
        for key, seqs in batch.items():
            for part in chunks(seqs):
                try:
                    answer = await self._ack(key, part)
                except BrokerUnavailable as exc:
                    unsent.setdefault(key, []).extend(part)
                    self.failures.failed(exc, source=SOURCE)
                    continue  # the slots stay taken until the retry
                except BrokerError as exc:  # rejected: retrying won't help; leases expire
                    log_ack_failed(self.config, key, part, exc)
                else:
                    self.failures.succeeded(source=SOURCE)
                    self._record(key, answer)
                self.budget_of(key).release(len(part))
        return unsent

    async def _ack(self, key: str, seqs: list[int]) -> dict[str, Any]:
        cfg = self.config
        subject, partition = split_partition_log(key)
        if partition is None:  # a plain subject: the call as clients without partitions have it
            return await self.client.ack(subject, cfg.group, cfg.consumer_id, seqs)
        return await self.client.ack(subject, cfg.group, cfg.consumer_id, seqs, partition=partition)

    def _record(self, subject: str, answer: dict[str, Any]) -> None:
        self.counters.add("acked", int(answer.get("acked", 0)))
        unknown = answer.get("unknown") or []
        if unknown:
            self.counters.add("ack_unknown", len(unknown))
            log_ack_unknown(self.config, subject, unknown)
