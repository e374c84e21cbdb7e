"""``Consumer.run()``: pullers, handler workers and an ack flusher on named threads.

One puller per subject long-polls the broker for as many messages as the lease budget
allows and queues them; ``concurrency`` workers run handlers; acks are buffered and sent
by one flusher thread; nacks go out at once from the worker. Any loop that dies takes the
consumer down with it (``ConsumerCrashed``), after the same graceful shutdown as a stop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from qmq_outbox.consumer.acks import AckBuffer, chunks
from qmq_outbox.consumer.budget import LeaseBudget, next_want
from qmq_outbox.consumer.config import ConsumerConfig, Counters, PullClient
from qmq_outbox.consumer.handlers import Ack, HandlerSpec, Nack, Result, handle_batch
from qmq_outbox.consumer.logs import (
    FINAL_ACK_ATTEMPTS,
    STOPPED_ERROR,
    backoff,
    ids,
    log_ack_failed,
    log_dropped,
    log_pull_failed,
)
from qmq_outbox.envelope import Message
from qmq_outbox.errors import BrokerError, BrokerUnavailable

logger = logging.getLogger(__name__)

STOP = object()


class Acker:
    """Buffers acks and sends them from its own thread: by size, by interval, when hurried,
    on close. A sent ack gives its lease slot back to the budget."""

    def __init__(
        self,
        *,
        client: PullClient,
        config: ConsumerConfig,
        counters: Counters,
        budget: LeaseBudget,
    ) -> None:
        self._client = client
        self._config = config
        self._counters = counters
        self._budget = budget
        self._buffer = AckBuffer(max_size=config.ack_batch_size, interval=config.ack_interval)
        self._cond = threading.Condition()
        self._closed = False
        self._retry_at = 0.0

    def add(self, subject: str, seq: int) -> None:
        with self._cond:
            first = len(self._buffer) == 0
            if self._buffer.add(subject, seq, time.monotonic()) or first or self._buffer.urgent:
                self._cond.notify()  # due now, or the flusher must start the interval's clock

    def hurry(self) -> None:
        with self._cond:
            self._buffer.hurry()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def run(self) -> None:
        failures = 0
        while True:
            batch, closing = self._next_batch()
            if batch:
                unsent = self.send(batch)
                if unsent:
                    failures += 1
                    if closing and failures >= FINAL_ACK_ATTEMPTS:
                        log_dropped(self._config, unsent)
                        self._budget.release(sum(len(seqs) for seqs in unsent.values()))
                        return
                    with self._cond:
                        self._buffer.put_back(unsent, time.monotonic())
                        self._retry_at = time.monotonic() + backoff(failures)
                    continue
                failures = 0
            if closing and not batch:
                return

    def _next_batch(self) -> tuple[dict[str, list[int]], bool]:
        with self._cond:
            while True:
                now = time.monotonic()
                due = self._buffer.due_in(now)
                wait = None if due is None else max(due, self._retry_at - now)
                if self._closed:
                    wait = None if due is None else min(max(0.0, self._retry_at - now), 0.2)
                    if wait:
                        self._cond.wait(wait)
                    return self._buffer.take(), True
                if wait is not None and wait <= 0:
                    return self._buffer.take(), False
                self._cond.wait(wait)

    def send(self, batch: dict[str, list[int]]) -> dict[str, list[int]]:
        """Ack every subject's seqs; returns what could not be sent (to retry)."""
        unsent: dict[str, list[int]] = {}
        cfg = self._config
        for subject, seqs in batch.items():
            for part in chunks(seqs):
                try:
                    answer = self._client.ack(subject, cfg.group, cfg.consumer_id, part)
                except BrokerUnavailable as exc:
                    unsent.setdefault(subject, []).extend(part)
                    log_ack_failed(cfg, subject, part, exc)
                    continue  # the slots stay taken until the retry
                except BrokerError as exc:  # rejected: retrying won't help; leases expire
                    log_ack_failed(cfg, subject, part, exc)
                else:
                    self._record(subject, answer)
                self._budget.release(len(part))
        return unsent

    def _record(self, subject: str, answer: dict[str, Any]) -> None:
        self._counters.add("acked", int(answer.get("acked", 0)))
        unknown = answer.get("unknown") or []
        if unknown:
            self._counters.add("ack_unknown", len(unknown))
            logger.info(
                "acks for leases the broker no longer holds for us (expired or redelivered)",
                extra={"action": "consumer.ack_unknown", "subject": subject, "seqs": unknown[:20]},
            )


class ThreadedRunner:
    """Owns the threads of one ``Consumer.run()``."""

    def __init__(
        self,
        *,
        config: ConsumerConfig,
        specs: dict[str, HandlerSpec],
        client: PullClient,
        counters: Counters,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.specs = specs
        self.client = client
        self.counters = counters
        self.stop = stop
        self.fatal: BaseException | None = None
        self.budget = LeaseBudget(config.capacity)
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.acker = Acker(client=client, config=config, counters=counters, budget=self.budget)
        self._pullers: list[threading.Thread] = []
        self._workers: list[threading.Thread] = []
        self._acker_thread: threading.Thread | None = None

    def _thread(self, name: str, target: Any, *args: Any) -> threading.Thread:
        full = f"qmq-consumer[{self.config.group}]-{name}"
        thread = threading.Thread(
            target=self._supervised, args=(name, target, *args), name=full, daemon=True
        )
        thread.start()
        return thread

    def _supervised(self, name: str, target: Any, *args: Any) -> None:
        try:
            target(*args)
        except BaseException as exc:
            logger.critical(
                "consumer loop died; stopping the consumer",
                exc_info=exc,
                extra={"action": "consumer.loop_died", "loop": name, "group": self.config.group},
            )
            if self.fatal is None:
                self.fatal = exc
            self.stop.set()

    def start(self) -> None:
        self._acker_thread = self._thread("acks", self.acker.run)
        for index in range(self.config.concurrency):
            self._workers.append(self._thread(f"worker-{index}", self._work))
        for subject in self.specs:
            self._pullers.append(self._thread(f"pull-{subject}", self._pull_loop, subject))
        logger.info(
            "consumer started",
            extra={
                "action": "consumer.started",
                "group": self.config.group,
                "consumer": self.config.consumer_id,
                "subjects": sorted(self.specs),
            },
        )

    # -- pulling ----------------------------------------------------------------------

    def _pull_loop(self, subject: str) -> None:
        cfg = self.config
        want, failures = 1, 0
        while not self.stop.is_set():
            granted = self.budget.acquire(want, self.acker.hurry)
            if granted == 0:
                return
            try:
                messages = self.client.pull(
                    subject,
                    cfg.group,
                    cfg.consumer_id,
                    max_messages=granted,
                    wait_ms=cfg.wait_ms,
                    mode=cfg.mode,
                    start=cfg.start,
                )
            except BrokerUnavailable as exc:
                self.budget.release(granted)
                failures += 1
                log_pull_failed(cfg, subject, exc, failures)
                self.stop.wait(backoff(failures))
                continue
            except BaseException:
                self.budget.release(granted)
                raise
            failures = 0
            self.budget.release(granted - len(messages))
            self.counters.add("pulled", len(messages))
            for message in messages:
                self.queue.put(message)
            want = next_want(last_pulled=len(messages), max_batch=cfg.max_batch)

    # -- handling ---------------------------------------------------------------------

    def _work(self) -> None:
        held: list[Any] = []  # an item taken while batching, for the next round
        while True:
            item = held.pop() if held else self.queue.get()
            if item is STOP:
                return
            spec = self.specs[item.subject]
            batch = [item]
            while len(batch) < spec.batch_limit:  # what is already queued, without waiting
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is STOP or more.subject != item.subject:
                    held.append(more)
                    break
                batch.append(more)
            results = handle_batch(spec, self.config.store_group, batch)
            for message, result in zip(batch, results, strict=True):
                self._finish(message, result)

    def _finish(self, message: Message, result: Result) -> None:
        """An ack keeps the lease slot until the acker has sent it; a nack frees it now."""
        if isinstance(result, Ack):
            self.counters.add("duplicates" if result.duplicate else "processed")
            self.acker.add(message.subject, message.seq)
            return
        try:
            self.nack(message, result)
        finally:
            self.budget.release(1)

    def nack(self, message: Message, result: Nack) -> None:
        cfg = self.config
        self.counters.add("nacked")
        try:
            self.client.nack(
                message.subject,
                cfg.group,
                cfg.consumer_id,
                [message.seq],
                delay_ms=result.delay_ms,
                error=result.error,
            )
        except BrokerError as exc:  # the lease expires and the broker redelivers anyway
            logger.warning(
                "nack failed; the lease will expire instead",
                extra=ids(cfg, message) | {"action": "consumer.nack_failed", "error": str(exc)},
            )

    # -- stopping ---------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop pulling, finish what was pulled within the timeout, flush acks."""
        cfg = self.config
        deadline = time.monotonic() + cfg.shutdown_timeout
        self.stop.set()
        self.budget.close()
        _join_all(self._pullers, deadline)
        for _ in self._workers:
            self.queue.put(STOP)
        _join_all(self._workers, deadline)
        self._release_unstarted()
        stuck = sum(thread.is_alive() for thread in self._workers)
        if stuck:
            logger.error(
                "handlers still running at the stop timeout; their leases will expire",
                extra={"action": "consumer.stop_timeout", "group": cfg.group, "running": stuck},
            )
        self.acker.close()
        if self._acker_thread is not None:
            self._acker_thread.join(max(1.0, deadline - time.monotonic()) + 5.0)
        logger.info(
            "consumer stopped",
            extra={"action": "consumer.stopped", "group": cfg.group, "consumer": cfg.consumer_id},
        )

    def _release_unstarted(self) -> None:
        """Messages no worker got to: nack them now so others need not wait for the lease."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Message):
                self.nack(item, Nack(delay_ms=0, error=STOPPED_ERROR))
                self.budget.release(1)


def _join_all(threads: list[threading.Thread], deadline: float) -> None:
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
