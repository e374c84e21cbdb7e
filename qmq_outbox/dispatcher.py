"""Send committed messages to the broker in the background and mark their rows ``sent``.

``Dispatch`` is the logic, without I/O: a bounded backlog fed by ``submit()``, which never
blocks (when the backlog is full, or the broker was just found unavailable, the messages
are left to the compensator: their rows stay ``pending``), the batches to send, and what
to do with each send's report. Two drivers run it: ``ThreadDispatcher`` (named daemon
threads) for sync engines and ``AsyncDispatcher`` (named tasks on the application's event
loop) for asyncio engines. Rows are marked on the dispatcher's own connections, never the
caller's. An unavailable broker, or a database where rows cannot be marked, is logged once
when it starts failing, summarised while it lasts and logged once when it recovers
(``FailureLog``); after each failed send the breaker stays open a little longer (jittered).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from qmq_outbox import tracing
from qmq_outbox.backoff import backoff_seconds
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerUnavailable, OutboxStoreError, QmqError
from qmq_outbox.failure_log import DEFAULT_SUMMARY_INTERVAL, FailureLog, client_url
from qmq_outbox.sending import SendReport, send, send_async
from qmq_outbox.store import AsyncOutboxStore, OutboxStore, utcnow

logger = logging.getLogger(__name__)

DEFAULT_NAME = "qmq-outbox-dispatcher"
Item = tuple[Engine, OutgoingMessage]


class Backlog:
    """A bounded FIFO of (engine, message); not thread-safe by itself."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.deque[Item] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> bool:
        """Take all of ``messages`` or none of them."""
        if len(self._items) + len(messages) > self.capacity:
            return False
        self._items.extend((engine, m) for m in messages)
        return True

    def take(self, limit: int) -> list[Item]:
        count = min(limit, len(self._items))
        return [self._items.popleft() for _ in range(count)]


def by_engine(items: Sequence[Item]) -> dict[Engine, list[OutgoingMessage]]:
    grouped: dict[Engine, list[OutgoingMessage]] = {}
    for engine, message in items:
        grouped.setdefault(engine, []).append(message)
    return grouped


def _log_report(report: SendReport, marked: int) -> None:
    if report.results:
        logger.debug(
            "sent %d message(s), marked %d row(s)",
            len(report.results),
            marked,
            extra={"action": "outbox.sent", "count": len(report.results), "marked": marked},
        )
    for message, error in report.rejected:
        logger.error(
            "broker rejected message %s: %s",
            message.id,
            error,
            extra={"action": "outbox.rejected", "message_id": message.id, "code": error.code},
        )
    if report.error is not None:  # the outage itself is logged by Dispatch.broker
        logger.debug(
            "broker unavailable, %d message(s) left to the compensator: %s",
            len(report.unsent),
            report.error,
            extra={"action": "outbox.dispatch_failed", "count": len(report.unsent)},
        )


def _log_skipped(messages: Sequence[OutgoingMessage]) -> None:
    logger.debug(
        "broker recently unavailable, %d message(s) left to the compensator",
        len(messages),
        extra={"action": "outbox.dispatch_skipped", "count": len(messages)},
    )


class _Breaker:
    """After a failure, skip sending for a while (rows wait for the compensator): about
    ``cooldown`` seconds, doubling with each failure in a row up to ``max_cooldown``."""

    def __init__(self, cooldown: float, max_cooldown: float) -> None:
        self.cooldown = cooldown
        self.max_cooldown = max(cooldown, max_cooldown)
        self._open_until = 0.0

    def allows(self) -> bool:
        return time.monotonic() >= self._open_until

    def open(self, failures: int) -> None:
        pause = backoff_seconds(failures, base=self.cooldown, cap=self.max_cooldown)
        self._open_until = time.monotonic() + max(pause, self.cooldown)


class Dispatch:
    """The dispatcher's state and decisions; the drivers guard it (a lock, or one loop).

    ``broker`` follows the broker's outages (``target`` is its URL) and ``databases`` those
    of each engine's database.
    """

    def __init__(
        self,
        *,
        capacity: int,
        batch_size: int,
        cooldown: float,
        max_cooldown: float = 15.0,
        target: str = "broker",
        outage_summary_interval: float = DEFAULT_SUMMARY_INTERVAL,
    ) -> None:
        self.backlog = Backlog(capacity)
        self.batch_size = batch_size
        self.breaker = _Breaker(cooldown, max_cooldown)
        self.closing = False
        self.summary_interval = outage_summary_interval
        self.broker = FailureLog(
            what="dispatcher: broker",
            target=target,
            action="outbox.dispatcher.broker",
            logger=logger,
            expected=(BrokerUnavailable,),
            summary_interval=outage_summary_interval,
        )
        self.databases: dict[str, FailureLog] = {}

    @property
    def cooling_down(self) -> bool:
        """A send failed moments ago: messages are left to the compensator for now."""
        return not self.breaker.allows()

    def offer(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> bool:
        """Queue committed messages; False (rows stay pending) if full, closed or cooling down."""
        if self.closing or not self.breaker.allows():
            return False
        return self.backlog.offer(engine, messages)

    def take(self) -> list[Item]:
        return self.backlog.take(self.batch_size)

    def sends(self, batch: list[Item]) -> Iterator[tuple[Engine, list[OutgoingMessage]]]:
        """The batch's messages by engine, as long as the broker is not cooling down."""
        for engine, messages in by_engine(batch).items():
            if self.breaker.allows():
                yield engine, messages
            else:
                _log_skipped(messages)

    def completion(self, report: SendReport) -> dict[str, Any]:
        """Learn from a send (a failure opens the breaker); the store's ``mark_dispatched``
        arguments for its rows: sent ones, and rejected ones dead."""
        if report.error is not None:
            self.breaker.open(self.broker.failed(report.error))
        elif report.results or report.rejected:
            self.broker.succeeded()
        return {
            "sent_ids": [r.id for r in report.results],
            "dead": [(message.id, str(error)) for message, error in report.rejected],
            "now": utcnow(),
        }

    def settled(self, engine: Engine, report: SendReport, marked: int | QmqError) -> None:
        """Log a send and how marking its rows went (a failure leaves them to the
        compensator, whose resend the broker deduplicates)."""
        database = self._database(engine)
        if isinstance(marked, QmqError):
            database.failed(marked)
            logger.debug(
                "could not mark rows; the compensator will resend (deduplicated)",
                extra={"action": "outbox.mark_failed", "count": _count(report)},
            )
            marked = 0
        else:
            database.succeeded()
        _log_report(report, marked)

    def _database(self, engine: Engine) -> FailureLog:
        target = engine.url.render_as_string(hide_password=True)
        log = self.databases.get(target)
        if log is None:  # setdefault: two sender threads may get here at once
            log = self.databases.setdefault(
                target,
                FailureLog(
                    what="dispatcher: database",
                    target=target,
                    action="outbox.dispatcher.database",
                    logger=logger,
                    expected=(OutboxStoreError,),
                    summary_interval=self.summary_interval,
                ),
            )
        return log


def _count(report: SendReport) -> int:
    return len(report.results) + len(report.rejected) + len(report.unsent)


def _log_drain_timeout(drain_timeout: float, left: int) -> None:
    logger.warning(
        "dispatcher did not drain within %.1fs; the rest stays pending",
        drain_timeout,
        extra={"action": "outbox.drain_timeout", "left": left},
    )


Client = TypeVar("Client", BrokerClient, AsyncBrokerClient)


class _Driver(Generic[Client]):
    """The settings of both drivers: ``senders`` send at once, named ``<name>-<n>``.

    After a failed send, messages go straight to the compensator for ``cooldown`` seconds,
    doubling with each failure in a row up to ``max_cooldown``; an outage is summarised in
    the log every ``outage_summary_interval`` seconds.
    """

    def __init__(
        self,
        client: Client,
        *,
        capacity: int = 10_000,
        batch_size: int = 500,
        senders: int = 2,
        cooldown: float = 1.0,
        max_cooldown: float = 15.0,
        outage_summary_interval: float = DEFAULT_SUMMARY_INTERVAL,
        name: str = DEFAULT_NAME,
    ) -> None:
        self._client: Client = client
        self._dispatch = Dispatch(
            capacity=capacity,
            batch_size=batch_size,
            cooldown=cooldown,
            max_cooldown=max_cooldown,
            target=client_url(client),
            outage_summary_interval=outage_summary_interval,
        )
        self._senders = senders
        self._name = name
        self._setup()

    def _setup(self) -> None:
        """The driver's own state."""


class ThreadDispatcher(_Driver[BrokerClient]):
    """Background senders for sync engines, started by the first ``submit()``.

    ``senders`` threads (named ``<name>-<n>``) take batches from one backlog, so a batch can
    go out while another waits for the broker's durable answer; batches of different
    transactions may therefore be stored in either order.
    """

    def _setup(self) -> None:
        self._cond = threading.Condition()
        self._abandon = False
        self._threads: list[threading.Thread] = []
        self._stores: weakref.WeakKeyDictionary[Engine, OutboxStore] = weakref.WeakKeyDictionary()

    @property
    def cooling_down(self) -> bool:
        """Whether ``submit`` refuses because a send failed moments ago (not a full queue)."""
        return self._dispatch.cooling_down

    def submit(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> bool:
        """Queue committed messages; False (rows stay pending) if full, closed or cooling down."""
        with self._cond:
            if not self._dispatch.offer(engine, messages):
                return False
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < self._senders:
                name = f"{self._name}-{len(self._threads) + 1}"
                thread = threading.Thread(target=self._run, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
            self._cond.notify()
            return True

    def close(self, drain_timeout: float = 10.0) -> bool:
        """Stop taking messages, send what is queued; True if drained within ``drain_timeout``."""
        with self._cond:
            self._dispatch.closing = True
            self._cond.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + drain_timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            with self._cond:
                self._abandon = True
            _log_drain_timeout(drain_timeout, len(self._dispatch.backlog))
            return False
        return True

    def _run(self) -> None:
        try:
            while batch := self._next_batch():
                for engine, messages in self._dispatch.sends(batch):
                    with tracing.sending("qmq send", messages) as traced:
                        report = traced(send(self._client, messages))
                    completion = self._dispatch.completion(report)
                    try:
                        marked: int | QmqError = self._store(engine).mark_dispatched(**completion)
                    except QmqError as exc:
                        marked = exc
                    self._dispatch.settled(engine, report, marked)
        except BaseException:
            logger.critical(
                "dispatcher thread died; committed messages now wait for the compensator",
                exc_info=True,
                extra={"action": "outbox.dispatcher_died"},
            )
            raise

    def _next_batch(self) -> list[Item]:
        """The next batch to send; empty once closed and drained (or abandoned)."""
        with self._cond:
            while not self._dispatch.backlog and not self._dispatch.closing:
                self._cond.wait()
            return [] if self._abandon else self._dispatch.take()

    def _store(self, engine: Engine) -> OutboxStore:
        with self._cond:
            store = self._stores.get(engine)
            if store is None:
                store = self._stores[engine] = OutboxStore(engine)
            return store


class AsyncDispatcher(_Driver[AsyncBrokerClient]):
    """Background senders for asyncio engines: ``senders`` tasks on the loop that
    ``submit()`` runs on, taking batches from one backlog."""

    def _setup(self) -> None:
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stores: weakref.WeakKeyDictionary[Engine, AsyncOutboxStore] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def cooling_down(self) -> bool:
        """Whether ``submit`` refuses because a send failed moments ago (not a full queue)."""
        return self._dispatch.cooling_down

    def submit(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> bool:
        """Queue committed messages (call on the loop's thread); False if they must wait."""
        if not self._dispatch.offer(engine, messages):
            return False
        loop = asyncio.get_running_loop()
        self._tasks = [t for t in self._tasks if not t.done()]
        while len(self._tasks) < self._senders:
            name = f"{self._name}-{len(self._tasks) + 1}"
            task = loop.create_task(self._run(), name=name)
            task.add_done_callback(_report_death)
            self._tasks.append(task)
        self._wake.set()
        return True

    async def aclose(self, drain_timeout: float = 10.0) -> bool:
        """Stop taking messages, send what is queued; True if drained within ``drain_timeout``."""
        self._dispatch.closing = True
        if not self._tasks:
            return True
        self._wake.set()
        _, pending = await asyncio.wait(self._tasks, timeout=drain_timeout)
        if pending:
            for task in pending:
                task.cancel()
            _log_drain_timeout(drain_timeout, len(self._dispatch.backlog))
            return False
        return True

    async def _run(self) -> None:
        while batch := await self._next_batch():
            for engine, messages in self._dispatch.sends(batch):
                with tracing.sending("qmq send", messages) as traced:
                    report = traced(await send_async(self._client, messages))
                completion = self._dispatch.completion(report)
                try:
                    marked: int | QmqError = await self._store(engine).mark_dispatched(**completion)
                except QmqError as exc:
                    marked = exc
                self._dispatch.settled(engine, report, marked)

    async def _next_batch(self) -> list[Item]:
        while not self._dispatch.backlog and not self._dispatch.closing:
            self._wake.clear()  # one loop thread: no wake-up can slip in between
            await self._wake.wait()
        return self._dispatch.take()

    def _store(self, engine: Engine) -> AsyncOutboxStore:
        store = self._stores.get(engine)
        if store is None:
            store = self._stores[engine] = AsyncOutboxStore(AsyncEngine(engine))
        return store


def _report_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.critical(
            "dispatcher task died; committed messages now wait for the compensator",
            exc_info=task.exception(),
            extra={"action": "outbox.dispatcher_died"},
        )
