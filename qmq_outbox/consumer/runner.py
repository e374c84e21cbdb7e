"""The consumer's one runner: pullers, handler workers and an acker as tasks on one loop.

One puller task per subject long-polls the broker for as many messages as the lease budget
allows and queues them; ``concurrency`` worker tasks take them: coroutine handlers run on
the loop, plain ones (and sync stores) on ``concurrency`` named handler threads. Acks are
buffered and sent by the acker task, or carried by the subject's next pull while it is
busy (``ack_and_pull``: one request instead of two); nacks go out at once from the
worker. Any loop that dies takes the consumer down with it (``ConsumerCrashed``), after
the same graceful
shutdown as a stop. ``Consumer.run()`` drives this runner with ``asyncio.run`` on the
caller's thread, ``Consumer.run_async()`` on the caller's loop.

An ordered handler's subject is pulled in ``"ordered"`` mode and its messages go to one lane
per key of a partition (``lanes.py``) instead of the shared queue: a worker takes a whole
lane and runs its messages one after another, so one key's handlers never overlap and
different keys' run on different workers. The broker serves a key's next messages only
once those out are acked, and keeps up to ``KEYS_PER_WORKER * concurrency`` keys per
partition in flight (the pull's ``max_keys``; the consumer's ``ordered_keys`` overrides
it), so that the next keys wait leased while the workers run. A failure nacks that message
and the rest of its lane in one request (they come back together, in order; the broker
counts an attempt for the failed one only) and runs none of them; when a lane is done its
acks are sent at once, since the broker serves a key's next messages only once these are
acked. Ordered subjects draw on a lease
budget of their own,
``concurrency * LANE_BATCH``, and ask for all of it that is free: the broker shares a pull
out over the partitions this consumer holds, so they all run, each on batches of a useful
size (a partition can be held by one consumer only, so holding its messages takes nothing
from the group's other consumers).

An unavailable broker is retried with a jittered backoff; the pullers and the acker share
one ``FailureLog``, so an outage is one line when it starts, a summary every
``config.outage_summary`` seconds and one line when it clears. Each handler runs in a
``qmq handle <subject>`` span when tracing is on (``qmq_outbox.tracing``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from qmq_outbox import tracing
from qmq_outbox.consumer.acker import Acker
from qmq_outbox.consumer.budget import LeaseBudget, next_want
from qmq_outbox.consumer.clients import PullClient
from qmq_outbox.consumer.config import ConsumerConfig, Counters
from qmq_outbox.consumer.handlers import (
    Ack,
    HandlerSpec,
    Nack,
    Result,
    handle_async,
    handle_batch_async,
)
from qmq_outbox.consumer.lanes import Lane, Lanes
from qmq_outbox.consumer.logs import (
    STOPPED_ERROR,
    broker_failures,
    handler_failures,
    ids,
    log_handler_failed,
    retry_pause,
)
from qmq_outbox.consumer.threads import ThreadPool
from qmq_outbox.envelope import Message
from qmq_outbox.errors import BrokerError, BrokerUnavailable
from qmq_outbox.failure_log import client_url, delivery, describe
from qmq_wire import MAX_KEYS_IN_FLIGHT
from qmq_wire.ordered import split_partition_log
from qmq_wire.rules import tags_match

logger = logging.getLogger(__name__)
T = TypeVar("T")

ACK_FLUSH_GRACE = 5.0  # seconds the acker gets at a stop beyond the handlers' deadline
LANE_BATCH = 16  # an ordered subject's leases held at once: this many per worker
KEYS_PER_WORKER = 2  # an ordered partition's keys in flight: this many per worker


class Runner:
    """Owns the tasks and handler threads of one ``run()`` / ``run_async()``."""

    def __init__(
        self,
        *,
        config: ConsumerConfig,
        specs: dict[str, HandlerSpec],
        client: PullClient,
        counters: Counters,
        stop: asyncio.Event,
        tag_filter: bool = False,
    ) -> None:
        self.config = config
        self.specs = specs
        self.tag_filter = tag_filter  # the transport filters by tags on pull
        self.client = client
        self.counters = counters
        self.stop = stop
        self.fatal: BaseException | None = None
        self.budget = LeaseBudget(config.capacity)
        # An ordered subject's partitions are this consumer's alone while it holds them,
        # and each has at most one batch out at a time: a budget of their own, big enough
        # for a batch per partition a worker can run, so that many partitions run at once
        # and each on batches of a useful size (the plain subjects' budget would spread
        # over them a few messages each).
        self.lane_budget = LeaseBudget(config.concurrency * LANE_BATCH)
        self.queue: asyncio.Queue[Message | Lane | None] = asyncio.Queue()
        self.lanes = Lanes()  # the ordered subjects' partitions
        self.broker_failures = broker_failures(
            config, client_url(client), summary_interval=config.outage_summary
        )
        self.handler_failures = handler_failures(config)
        self.acker = Acker(
            client=client,
            config=config,
            counters=counters,
            budget_of=self._budget_of_key,
            failures=self.broker_failures,
        )
        self.threads = ThreadPool(config.concurrency, name=self.name("worker"))
        self._pullers: list[asyncio.Task[None]] = []
        self._workers: list[asyncio.Task[None]] = []
        self._acker_task: asyncio.Task[None] | None = None

    def name(self, part: str) -> str:
        return f"qmq-consumer[{self.config.group}]-{part}"

    def _task(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return asyncio.create_task(self._supervised(name, coro), name=self.name(name))

    async def _supervised(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.critical(
                "consumer group %s: loop %s died; stopping the consumer",
                self.config.group,
                name,
                exc_info=exc,
                extra={"action": "consumer.loop_died", "loop": name, "group": self.config.group},
            )
            if self.fatal is None:
                self.fatal = exc
            self.stop.set()

    def start(self) -> None:
        self.threads.start()
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

    # -- pulling ----------------------------------------------------------------------

    async def _pull_loop(self, subject: str) -> None:
        cfg = self.config
        source = f"pull {subject}"
        ordered = self.specs[subject].ordered
        budget = self._budget(subject)
        # An ordered pull asks for every free slot: the broker shares them out over the
        # partitions this consumer holds.
        max_batch = budget.capacity if ordered else cfg.max_batch
        want, busy = 1, False
        while not self.stop.is_set():
            # An ordered pull carries no acks: they name the partition, pulls do not.
            granted, carried = await self._reserve(subject, want, busy=busy and not ordered)
            if granted + len(carried) == 0:
                return
            held = granted + len(carried)  # the carried acks' slots pass to this pull
            try:
                messages = await self._pull(subject, min(held, max(want, 1)), carried)
            except BrokerUnavailable as exc:
                self._give_back(subject, granted, carried)
                failures = self.broker_failures.failed(exc, source=source)
                await self._pause(retry_pause(failures))
                continue
            except BaseException:
                self._give_back(subject, granted, carried)
                raise
            self.broker_failures.succeeded(source=source)
            if not messages:
                self.acker.idle()
            budget.release(held - len(messages))
            self.counters.add("pulled", len(messages))
            if ordered:
                self._to_lanes(messages)
            else:
                wanted = self.specs[subject].tags
                for message in messages:
                    if wanted and not tags_match(message.tags, wanted):
                        # A transport that cannot filter (JetStream, RabbitMQ): acked unrun.
                        self.counters.add("filtered")
                        self.acker.add(message.subject, message.seq)
                    else:
                        self.queue.put_nowait(message)
            want = next_want(last_pulled=len(messages), max_batch=max_batch)
            busy = bool(messages)

    async def _reserve(self, subject: str, want: int, *, busy: bool) -> tuple[int, list[int]]:
        """Lease slots for the next pull, and the buffered acks it carries.

        While the subject is busy (the last pull got messages) the pull carries the acks
        buffered for it: one request instead of two. With no free slot it carries them
        instead of waiting for the acker to send them; with none buffered either, it
        waits for a slot (hurrying the acker). A long poll carries nothing.
        """
        budget = self._budget(subject)
        granted = budget.try_acquire(want)
        carried = self.acker.carry(subject) if busy else []
        if granted or carried:
            return granted, carried
        granted = await budget.acquire(want, self.acker.hurry)
        return granted, []

    async def _pull(self, subject: str, max_messages: int, carried: list[int]) -> list[Message]:
        cfg = self.config
        options: dict[str, Any] = {
            "max_messages": max_messages,
            "wait_ms": cfg.wait_ms,
            "mode": "ordered" if self.specs[subject].ordered else cfg.mode,
            "start": cfg.start,
        }
        if self.specs[subject].ordered:
            default = min(KEYS_PER_WORKER * cfg.concurrency, MAX_KEYS_IN_FLIGHT)
            options["max_keys"] = cfg.ordered_keys or default
        if self.specs[subject].tags and self.tag_filter:
            options["tags"] = list(self.specs[subject].tags)
        if not carried:
            return await self.client.pull(subject, cfg.group, cfg.consumer_id, **options)
        # Acks on board: the broker applies them on arrival, but their answer (and slots)
        # come with the pull's, so it waits for messages no longer than the acker would
        # have held the acks. At a steady trickle that is one request a message, not a
        # pull and then an ack; a quiet subject's next pull waits, carrying nothing.
        options["wait_ms"] = min(cfg.wait_ms, round(cfg.ack_interval * 1000))
        answer = await self.client.ack_and_pull(
            subject, cfg.group, cfg.consumer_id, carried, **options
        )
        self.acker.carried(subject, answer)
        return answer.messages

    def _budget(self, subject: str) -> LeaseBudget:
        return self.lane_budget if self.specs[subject].ordered else self.budget

    def _budget_of_key(self, key: str) -> LeaseBudget:
        """The budget an ack's slots go back to: ``key`` is a subject, or an ordered
        subject's partition log ``subject#p``."""
        return self.budget if split_partition_log(key)[1] is None else self.lane_budget

    def _give_back(self, subject: str, granted: int, carried: list[int]) -> None:
        """A pull failed: its new slots are free again, its acks go back to the acker."""
        self._budget(subject).release(granted)
        if carried:
            self.acker.put_back(subject, carried)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake up for a stop."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass

    # -- handling ---------------------------------------------------------------------

    async def _work(self) -> None:
        held: list[Message | Lane | None] = []  # an item taken while batching, for later
        while True:
            message = held.pop() if held else await self.queue.get()
            if message is None:
                return
            if isinstance(message, Lane):
                await self._run_lane(message)
                continue
            spec = self.specs[message.subject]
            batch = [message]
            while len(batch) < spec.batch_limit and not self.queue.empty():
                more = self.queue.get_nowait()
                if not isinstance(more, Message) or more.subject != message.subject:
                    held.append(more)
                    break
                batch.append(more)
            group = self.config.store_group
            with tracing.handling(message.subject, self.config.group, batch):
                results = await handle_batch_async(spec, group, batch, self._on_thread)
            for one, result in zip(batch, results, strict=True):
                await self._finish(one, result)

    # -- ordered handlers -------------------------------------------------------------

    def _to_lanes(self, messages: list[Message]) -> None:
        """An ordered pull's messages onto their partitions' lanes; an idle lane goes to
        the workers."""
        for message in messages:
            lane = self.lanes.add(message)
            if lane is not None:
                self.queue.put_nowait(lane)

    async def _run_lane(self, lane: Lane) -> None:
        """Run a key's messages one at a time until none is left; at a failure, give
        that message and the rest back in one nack. Once stopping, leave the rest on the
        lane: ``shutdown`` returns them after the pulls ended, so that none of our own
        pulls takes them again."""
        spec = self.specs[lane.subject]
        group = self.config.store_group
        while not self.stop.is_set() and (message := self.lanes.next(lane)) is not None:
            with tracing.handling(message.subject, self.config.group, [message]):
                result = await handle_async(spec, group, message, self._on_thread)
            if isinstance(result, Ack):
                self.counters.add("duplicates" if result.duplicate else "processed")
                self.acker.add(lane.key, message.seq)
            else:
                self._log_failure(message, result)
                await self._nack_lane(lane, message, result)
        # The broker serves this key's next message only once the last one is acked.
        self.acker.send_now()

    async def _nack_lane(self, lane: Lane, first: Message, result: Nack) -> None:
        """Nack ``first`` and every message after it on ``lane``, in one request with one
        delay: they come back together and in order, and none runs before ``first``."""
        batch = [first, *lane.take_rest()]
        try:
            await self._nack_ordered(lane, batch, result)
        finally:
            self.lane_budget.release(len(batch))

    async def _nack_ordered(self, lane: Lane, batch: list[Message], result: Nack) -> None:
        cfg = self.config
        self.counters.add("nacked", len(batch))
        seqs = list(dict.fromkeys(m.seq for m in batch))  # a redelivered copy may be there too
        try:
            await self.client.nack(
                lane.subject,
                cfg.group,
                cfg.consumer_id,
                seqs,
                delay_ms=result.delay_ms,
                error=result.error,
                partition=lane.partition,
            )
        except BrokerError as exc:  # the leases expire and the broker redelivers anyway
            logger.warning(
                "consumer group %s: nack of partition %s from %s (%d message(s)) failed; "
                "the leases will expire instead: %s",
                cfg.group,
                lane.partition,
                delivery(batch[0]),
                len(seqs),
                describe(exc),
                extra=ids(cfg, batch[0])
                | {
                    "action": "consumer.nack_failed",
                    "partition": lane.partition,
                    "count": len(seqs),
                    "error": str(exc),
                },
            )

    async def _on_thread(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` on a handler thread, in this task's context (its current span)."""
        return await self.threads.run(contextvars.copy_context().run, fn, *args)

    async def _finish(self, message: Message, result: Result) -> None:
        """An ack keeps the lease slot until the acker has sent it; a nack frees it now."""
        if isinstance(result, Ack):
            self.counters.add("duplicates" if result.duplicate else "processed")
            self.acker.add(message.subject, message.seq)
            return
        self._log_failure(message, result)
        try:
            await self.nack(message, result)
        finally:
            self.budget.release(1)

    def _log_failure(self, message: Message, result: Nack) -> None:
        if result.failure is not None:
            log_handler_failed(self.handler_failures, self.config, message, result.failure)

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
        except BrokerError as exc:  # the lease expires and the broker redelivers anyway
            logger.warning(
                "consumer group %s: nack of %s failed; the lease will expire instead: %s",
                cfg.group,
                delivery(message),
                describe(exc),
                extra=ids(cfg, message) | {"action": "consumer.nack_failed", "error": str(exc)},
            )

    # -- stopping ---------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop pulling, finish what was pulled within the timeout, flush acks."""
        cfg = self.config
        deadline = time.monotonic() + cfg.shutdown_timeout
        self.stop.set()
        self.budget.close()
        self.lane_budget.close()
        await _wait_all(self._pullers, deadline)
        for _ in self._workers:
            self.queue.put_nowait(None)
        stuck = await _wait_all(self._workers, deadline)
        await self._release_unstarted()
        if stuck:
            logger.error(
                "consumer group %s: %d handler(s) still running at the stop timeout; their "
                "leases will expire",
                cfg.group,
                stuck,
                extra={"action": "consumer.stop_timeout", "group": cfg.group, "running": stuck},
            )
        self.handler_failures.flush()
        self.threads.close()
        self.acker.close()
        if self._acker_task is not None:
            flush_deadline = max(time.monotonic() + 1.0, deadline) + ACK_FLUSH_GRACE
            await _wait_all([self._acker_task], flush_deadline)
        logger.info(
            "consumer stopped",
            extra={"action": "consumer.stopped", "group": cfg.group, "consumer": cfg.consumer_id},
        )

    async def _release_unstarted(self) -> None:
        """Messages no worker got to: nack them now so others need not wait for the lease.
        A partition's are nacked together (its lane: queued, left at the stop, or left by
        a handler that ran past the timeout)."""
        stopped = Nack(delay_ms=0, error=STOPPED_ERROR)
        while not self.queue.empty():
            message = self.queue.get_nowait()
            if isinstance(message, Message):
                await self._finish(message, stopped)
        for lane, rest in self.lanes.take_all():
            try:
                await self._nack_ordered(lane, rest, stopped)
            finally:
                self.lane_budget.release(len(rest))


async def _wait_all(tasks: list[asyncio.Task[None]], deadline: float) -> int:
    """Wait for the tasks until the deadline, then cancel the rest; returns how many."""
    if not tasks:
        return 0
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    return len(pending)
