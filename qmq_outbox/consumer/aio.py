"""``Consumer.run_async()``: the same design as the threaded runner, as asyncio tasks.

One puller task per subject, ``concurrency`` worker tasks, one ack flusher task. Handlers
that are coroutines are awaited on the loop; plain ones run on the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from qmq_outbox.consumer.acks import AckBuffer, chunks
from qmq_outbox.consumer.budget import AsyncLeaseBudget, next_want
from qmq_outbox.consumer.config import AsyncPullClient, ConsumerConfig, Counters
from qmq_outbox.consumer.handlers import Ack, HandlerSpec, Nack, Result, handle_batch_async
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


class AsyncAcker:
    """The threaded ``Acker`` as a task."""

    def __init__(
        self,
        *,
        client: AsyncPullClient,
        config: ConsumerConfig,
        counters: Counters,
        budget: AsyncLeaseBudget,
    ) -> None:
        self._client = client
        self._config = config
        self._counters = counters
        self._budget = budget
        self._buffer = AckBuffer(max_size=config.ack_batch_size, interval=config.ack_interval)
        self._wake = asyncio.Event()
        self._closed = False

    def add(self, subject: str, seq: int) -> None:
        first = len(self._buffer) == 0
        if self._buffer.add(subject, seq, time.monotonic()) or first or self._buffer.urgent:
            self._wake.set()

    def hurry(self) -> None:
        self._buffer.hurry()
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def run(self) -> None:
        failures = 0
        retry_at = 0.0
        while True:
            closing = await self._wait_due(retry_at)
            batch = self._buffer.take()
            if batch:
                unsent = await self.send(batch)
                if unsent:
                    failures += 1
                    if closing and failures >= FINAL_ACK_ATTEMPTS:
                        log_dropped(self._config, unsent)
                        await self._budget.release(sum(len(seqs) for seqs in unsent.values()))
                        return
                    self._buffer.put_back(unsent, time.monotonic())
                    retry_at = time.monotonic() + (0.2 if closing else backoff(failures))
                    continue
                failures = 0
            if closing and not batch:
                return

    async def _wait_due(self, retry_at: float) -> bool:
        while True:
            now = time.monotonic()
            due = self._buffer.due_in(now)
            wait = None if due is None else max(due, retry_at - now)
            if self._closed:
                if due is not None and retry_at > now:
                    await asyncio.sleep(min(retry_at - now, 0.2))
                return True
            if wait is not None and wait <= 0:
                return False
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def send(self, batch: dict[str, list[int]]) -> dict[str, list[int]]:
        unsent: dict[str, list[int]] = {}
        cfg = self._config
        for subject, seqs in batch.items():
            for part in chunks(seqs):
                try:
                    answer = await self._client.ack(subject, cfg.group, cfg.consumer_id, part)
                except BrokerUnavailable as exc:
                    unsent.setdefault(subject, []).extend(part)
                    log_ack_failed(cfg, subject, part, exc)
                    continue
                except BrokerError as exc:
                    log_ack_failed(cfg, subject, part, exc)
                else:
                    self._counters.add("acked", int(answer.get("acked", 0)))
                    unknown = answer.get("unknown") or []
                    if unknown:
                        self._counters.add("ack_unknown", len(unknown))
                        logger.info(
                            "acks for leases the broker no longer holds for us",
                            extra={"action": "consumer.ack_unknown", "subject": subject},
                        )
                await self._budget.release(len(part))
        return unsent


class AsyncRunner:
    """Owns the tasks of one ``Consumer.run_async()``."""

    def __init__(
        self,
        *,
        config: ConsumerConfig,
        specs: dict[str, HandlerSpec],
        client: AsyncPullClient,
        counters: Counters,
        stop: asyncio.Event,
    ) -> None:
        self.config = config
        self.specs = specs
        self.client = client
        self.counters = counters
        self.stop = stop
        self.fatal: BaseException | None = None
        self.budget = AsyncLeaseBudget(config.capacity)
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self.acker = AsyncAcker(client=client, config=config, counters=counters, budget=self.budget)
        self._pullers: list[asyncio.Task[None]] = []
        self._workers: list[asyncio.Task[None]] = []
        self._acker_task: asyncio.Task[None] | None = None

    def _task(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        full = f"qmq-consumer[{self.config.group}]-{name}"
        return asyncio.create_task(self._supervised(name, coro), name=full)

    async def _supervised(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
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
        self._acker_task = self._task("acks", self.acker.run())
        for index in range(self.config.concurrency):
            self._workers.append(self._task(f"worker-{index}", self._work()))
        for subject in self.specs:
            self._pullers.append(self._task(f"pull-{subject}", self._pull_loop(subject)))
        logger.info(
            "consumer started",
            extra={
                "action": "consumer.started",
                "group": self.config.group,
                "consumer": self.config.consumer_id,
                "subjects": sorted(self.specs),
            },
        )

    async def _pull_loop(self, subject: str) -> None:
        cfg = self.config
        want, failures = 1, 0
        while not self.stop.is_set():
            granted = await self.budget.acquire(want, self.acker.hurry)
            if granted == 0:
                return
            try:
                messages = await self.client.pull(
                    subject,
                    cfg.group,
                    cfg.consumer_id,
                    max_messages=granted,
                    wait_ms=cfg.wait_ms,
                    mode=cfg.mode,
                    start=cfg.start,
                )
            except BrokerUnavailable as exc:
                await self.budget.release(granted)
                failures += 1
                log_pull_failed(cfg, subject, exc, failures)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), backoff(failures))
                continue
            except BaseException:
                await self.budget.release(granted)
                raise
            failures = 0
            await self.budget.release(granted - len(messages))
            self.counters.add("pulled", len(messages))
            for message in messages:
                self.queue.put_nowait(message)
            want = next_want(last_pulled=len(messages), max_batch=cfg.max_batch)

    async def _work(self) -> None:
        held: list[Message | None] = []  # an item taken while batching, for the next round
        while True:
            message = held.pop() if held else await self.queue.get()
            if message is None:
                return
            spec = self.specs[message.subject]
            batch = [message]
            while len(batch) < spec.batch_limit and not self.queue.empty():
                more = self.queue.get_nowait()
                if more is None or more.subject != message.subject:
                    held.append(more)
                    break
                batch.append(more)
            results = await handle_batch_async(spec, self.config.store_group, batch)
            for one, result in zip(batch, results, strict=True):
                await self._finish(one, result)

    async def _finish(self, message: Message, result: Result) -> None:
        if isinstance(result, Ack):
            self.counters.add("duplicates" if result.duplicate else "processed")
            self.acker.add(message.subject, message.seq)
            return
        try:
            await self.nack(message, result)
        finally:
            await self.budget.release(1)

    async def nack(self, message: Message, result: Nack) -> None:
        cfg = self.config
        self.counters.add("nacked")
        try:
            await self.client.nack(
                message.subject,
                cfg.group,
                cfg.consumer_id,
                [message.seq],
                delay_ms=result.delay_ms,
                error=result.error,
            )
        except BrokerError as exc:
            logger.warning(
                "nack failed; the lease will expire instead",
                extra=ids(cfg, message) | {"action": "consumer.nack_failed", "error": str(exc)},
            )

    async def shutdown(self) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.shutdown_timeout
        self.stop.set()
        await self.budget.close()
        await _wait_all(self._pullers, deadline)
        for _ in self._workers:
            self.queue.put_nowait(None)
        await _wait_all(self._workers, deadline)
        while not self.queue.empty():
            message = self.queue.get_nowait()
            if message is not None:
                await self.nack(message, Nack(delay_ms=0, error=STOPPED_ERROR))
        if any(not task.done() for task in self._workers):
            logger.error(
                "handlers still running at the stop timeout; cancelled, their leases will expire",
                extra={"action": "consumer.stop_timeout", "group": cfg.group},
            )
        self.acker.close()
        if self._acker_task is not None:
            await _wait_all([self._acker_task], time.monotonic() + 10.0)
        logger.info(
            "consumer stopped",
            extra={"action": "consumer.stopped", "group": cfg.group, "consumer": cfg.consumer_id},
        )


async def _wait_all(tasks: list[asyncio.Task[None]], deadline: float) -> None:
    """Wait for the tasks until the deadline, then cancel the rest."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
