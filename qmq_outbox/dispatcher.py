"""Send committed messages to the broker in the background and mark their rows ``sent``.

``Dispatch`` is the logic, without I/O (nor knowledge of the transport): a bounded backlog
fed by ``submit()``, which never blocks (when the backlog is full the messages are left to
the compensator: their rows stay ``pending``), the batches to send, and what to do with
each send's report. Two drivers run it:
``ThreadDispatcher`` (named daemon threads) for sync engines and ``AsyncDispatcher`` (named
tasks on the application's event loop) for asyncio engines. Rows are marked on the
dispatcher's own connections, never the caller's. An unavailable broker, or a database
where rows cannot be marked, is logged once when it starts failing, summarised while it
lasts and logged once when it recovers (``FailureLog``); after each failed send the breaker
stays open a little longer (jittered). A broker refusing the request as such (401, 403, a
wrong route: a configuration error) counts as unavailable: no row goes ``dead`` for it.

While the breaker is open the dispatcher keeps what it holds (the failed send's messages
and those committed meanwhile) and sends them when it closes again, as long as they are
younger than ``retry_for`` seconds: kept below the compensator's grace, the compensator
never sends a row the dispatcher may still send. Older ones are left to the compensator.
A message no queue takes (``unroutable``) is left to the compensator at once.

Keyed messages keep their key's order (docs/outbox.md, "Per-key order"). Each sender owns
a lane, and a (subject, key) always goes to the same lane (``KeyLanes``), so this
dispatcher never has one key in two sends at once. Before a send, the store's
``order_check`` says which keyed rows may go: those with no earlier unsent row of their key
outside the send; they go in outbox id order. A row held back (its earlier row is still
being sent elsewhere, or its commit's hand-off has not arrived yet) waits in its lane and is
tried again after ``hold_delay`` seconds, doubling, ``max_holds`` times; then it is left to
the compensator. Unkeyed messages share one backlog that every sender takes from, as before.

``ThreadDispatcher`` marks a send of unkeyed messages sent off the senders' path: a marker
thread (``Marks``) gathers their ids for up to ``mark_interval`` seconds (or ``MARK_BATCH``
ids) and marks them in one UPDATE per engine, and flushes what it holds at ``close()``.
Meanwhile those rows read ``pending`` (to the compensator, whose grace is far longer, and to
``qmq outbox status``). A send with keyed or rejected messages is marked at once: a key's
next row waits for its earlier one to read ``sent``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from qmq_outbox import tracing
from qmq_outbox.backoff import backoff_seconds
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable, OutboxStoreError, QmqError
from qmq_outbox.failure_log import DEFAULT_SUMMARY_INTERVAL, FailureLog, client_url
from qmq_outbox.sending import SendReport, send, send_async
from qmq_outbox.store import AsyncOutboxStore, OrderCheck, OutboxStore, utcnow
from qmq_outbox.transports.base import AsyncProducer, Producer
from qmq_outbox.unroutable import SubjectWarnings

logger = logging.getLogger(__name__)

DEFAULT_NAME = "qmq-outbox-dispatcher"
HOLD_DELAY = 0.02
MAX_HOLDS = 6  # 20 ms doubling: about 1.3 s in all before the compensator takes over
MARK_INTERVAL = 0.05
MARK_BATCH = 1000
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

    def put_back(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> None:
        """Messages of a failed send go back to the front (over ``capacity`` if need be:
        they were in it moments ago)."""
        self._items.extendleft((engine, m) for m in reversed(messages))

    def drop(self, keep: Callable[[OutgoingMessage], bool]) -> int:
        """Remove the messages ``keep`` refuses; returns how many."""
        before = len(self._items)
        self._items = collections.deque(item for item in self._items if keep(item[1]))
        return before - len(self._items)

    def clear(self) -> int:
        count = len(self._items)
        self._items.clear()
        return count


@dataclasses.dataclass(slots=True)
class Keyed:
    """A keyed message in its lane: held back ``holds`` times so far, not taken before
    ``due`` (``time.monotonic()``)."""

    engine: Engine
    message: OutgoingMessage
    holds: int = 0
    due: float = 0.0

    @property
    def order_key(self) -> tuple[str, str | None]:
        return self.message.subject, self.message.key


class KeyLanes:
    """Keyed messages in ``count`` lanes, one per sender; a (subject, key) always lands in
    the same lane. Not thread-safe by itself."""

    def __init__(self, count: int) -> None:
        self._lanes: list[collections.deque[Keyed]] = [
            collections.deque() for _ in range(max(1, count))
        ]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes)

    def lane_of(self, message: OutgoingMessage) -> int:
        return zlib.crc32(f"{message.subject}\0{message.key}".encode()) % len(self._lanes)

    def add(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> None:
        for message in messages:
            self._lanes[self.lane_of(message)].append(Keyed(engine, message))

    def is_empty(self, lane: int) -> bool:
        return not self._lanes[lane]

    def take(self, lane: int, limit: int, now: float) -> list[Keyed]:
        """Up to ``limit`` due messages of ``lane``, oldest first. A key with a message not
        due yet keeps its later messages back too: they could not go before it."""
        queue = self._lanes[lane]
        taken: list[Keyed] = []
        kept: list[Keyed] = []
        waiting: set[tuple[str, str | None]] = set()
        while queue and len(taken) < limit:
            entry = queue.popleft()
            if entry.due > now or entry.order_key in waiting:
                waiting.add(entry.order_key)
                kept.append(entry)
            else:
                taken.append(entry)
        queue.extendleft(reversed(kept))
        return taken

    def put_back(self, lane: int, entries: Sequence[Keyed]) -> None:
        """Held messages go back to the front of their lane: they are older than the rest."""
        self._lanes[lane].extendleft(reversed(entries))

    def drop(self, keep: Callable[[OutgoingMessage], bool]) -> int:
        """Remove the messages ``keep`` refuses, from every lane; returns how many."""
        dropped = 0
        for index, lane in enumerate(self._lanes):
            kept = collections.deque(entry for entry in lane if keep(entry.message))
            dropped += len(lane) - len(kept)
            self._lanes[index] = kept
        return dropped

    def next_due(self, lane: int, now: float) -> float | None:
        """When the next held message of ``lane`` falls due; None if none waits. (One that
        is due but behind a held message of its key waits for that one's time.)"""
        return min((e.due for e in self._lanes[lane] if e.due > now), default=None)


@dataclasses.dataclass(slots=True)
class Batch:
    """What one sender took: unkeyed messages from the backlog, keyed ones from its lane."""

    lane: int
    plain: list[Item] = dataclasses.field(default_factory=list)
    keyed: list[Keyed] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.plain or self.keyed)


@dataclasses.dataclass(slots=True)
class Send:
    """One engine's part of a batch."""

    engine: Engine
    plain: list[OutgoingMessage] = dataclasses.field(default_factory=list)
    keyed: list[Keyed] = dataclasses.field(default_factory=list)


def by_engine(batch: Batch) -> list[Send]:
    grouped: dict[Engine, Send] = {}
    for engine, message in batch.plain:
        grouped.setdefault(engine, Send(engine)).plain.append(message)
    for entry in batch.keyed:
        grouped.setdefault(entry.engine, Send(entry.engine)).keyed.append(entry)
    return list(grouped.values())


def _log_report(report: SendReport, marked: int) -> None:
    if report.results:
        logger.debug(
            "sent %d message(s), marked %d row(s)",
            len(report.results),
            marked,
            extra={"action": "outbox.sent", "count": len(report.results), "marked": marked},
        )
    for message, error in report.rejected:  # only rejections of the message itself
        logger.error(
            "broker rejected message %s of subject %s: %s",
            message.id,
            message.subject,
            error,
            extra={"action": "outbox.rejected", "message_id": message.id, "code": error.code},
        )
    if report.error is not None:  # the outage itself is logged by Dispatch.broker
        logger.debug(
            "broker unavailable or refusing, %d message(s) held for another try: %s",
            len(report.unsent),
            report.error,
            extra={"action": "outbox.dispatch_failed", "count": len(report.unsent)},
        )


def _log_skipped(count: int, why: str) -> None:
    logger.debug(
        "%s, %d message(s) left to the compensator",
        why,
        count,
        extra={"action": "outbox.dispatch_skipped", "count": count},
    )


def _log_held(held: int, left: int) -> None:
    logger.debug(
        "%d keyed message(s) wait for an earlier row of their key, %d left to the compensator",
        held,
        left,
        extra={"action": "outbox.order_held", "count": held, "left": left},
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

    def remaining(self) -> float:
        """Seconds until it closes again (0 when it is closed)."""
        return max(0.0, self._open_until - time.monotonic())

    def open(self, failures: int) -> None:
        pause = backoff_seconds(failures, base=self.cooldown, cap=self.max_cooldown)
        self._open_until = time.monotonic() + max(pause, self.cooldown)


class Dispatch:
    """The dispatcher's state and decisions; the drivers guard it (a lock, or one loop).

    ``broker`` follows the broker's outages (``target`` is its URL) and ``databases`` those
    of each engine's database. ``lanes``: one per sender, for keyed messages; a held-back
    keyed message is tried again after ``hold_delay`` seconds, doubling, ``max_holds`` times.
    ``retry_for``: how long after its publish a message the broker could not take is kept
    for another try (0: left to the compensator at once, and nothing is queued while the
    breaker is open).
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
        lanes: int = 1,
        hold_delay: float = HOLD_DELAY,
        max_holds: int = MAX_HOLDS,
        retry_for: float = 0.0,
    ) -> None:
        self.backlog = Backlog(capacity)
        self.retry_for = retry_for
        self.keyed = KeyLanes(lanes)
        self.batch_size = batch_size
        self.hold_delay = hold_delay
        self.max_holds = max_holds
        self.breaker = _Breaker(cooldown, max_cooldown)
        self.closing = False
        self.summary_interval = outage_summary_interval
        self.broker = FailureLog(
            what="dispatcher: broker",
            target=target,
            action="outbox.dispatcher.broker",
            logger=logger,
            expected=(BrokerUnavailable, BrokerRejected),
            summary_interval=outage_summary_interval,
        )
        self.unroutable = SubjectWarnings(
            logger=logger, action="outbox.unroutable", interval=outage_summary_interval
        )
        self.databases: dict[str, FailureLog] = {}

    @property
    def cooling_down(self) -> bool:
        """A send failed moments ago: sends wait (or, without ``retry_for``, messages are
        left to the compensator for now)."""
        return not self.breaker.allows()

    @property
    def queued(self) -> int:
        return len(self.backlog) + len(self.keyed)

    def offer(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> bool:
        """Queue committed messages; False (rows stay pending) if full or closed, or cooling
        down without ``retry_for``."""
        if self.closing or (not self.retry_for and not self.breaker.allows()):
            return False
        if self.queued + len(messages) > self.backlog.capacity:
            return False
        self.backlog.offer(engine, [m for m in messages if m.key is None])
        self.keyed.add(engine, [m for m in messages if m.key is not None])
        return True

    def take(self, lane: int = 0, now: float | None = None) -> Batch:
        """Lane ``lane``'s next batch: its due keyed messages and unkeyed ones, each kind
        getting at least half of ``batch_size`` when both wait."""
        now = time.monotonic() if now is None else now
        if not self.breaker.allows():  # wait for it to close; give up when closing
            if self.closing:
                self._give_up("broker unavailable at close")
            return Batch(lane)
        if self.broker.failing and self.retry_for:
            self._expire()
        keyed_room = self.batch_size - min(len(self.backlog), self.batch_size // 2)
        keyed = self.keyed.take(lane, keyed_room, now)
        return Batch(lane, self.backlog.take(self.batch_size - len(keyed)), keyed)

    def _expire(self) -> None:
        """Leave to the compensator what is too old for the dispatcher to send safely."""
        oldest = utcnow() - timedelta(seconds=self.retry_for)

        def young(message: OutgoingMessage) -> bool:
            return message.created_at is None or message.created_at >= oldest

        dropped = self.backlog.drop(young) + self.keyed.drop(young)
        if dropped:
            _log_skipped(dropped, f"broker unavailable for over {self.retry_for:g}s")

    def _give_up(self, why: str) -> None:
        dropped = self.backlog.clear() + self.keyed.drop(lambda message: False)
        if dropped:
            _log_skipped(dropped, why)

    def requeue(self, lane: int, engine: Engine, messages: Sequence[OutgoingMessage]) -> None:
        """Keep a failed send's messages for the next try (with ``retry_for``, until closing),
        ahead of the rest: they are older."""
        if not messages or not self.retry_for or self.closing:
            return
        self.backlog.put_back(engine, [m for m in messages if m.key is None])
        keyed = [Keyed(engine, m) for m in messages if m.key is not None]
        if keyed:
            self.keyed.put_back(lane, keyed)

    def drained(self, lane: int) -> bool:
        """Nothing left for lane ``lane``'s sender."""
        return not self.backlog and self.keyed.is_empty(lane)

    def wait_time(self, lane: int, now: float) -> float | None:
        """Seconds until lane ``lane`` may send again (its next held message is due, or the
        breaker closes while messages wait); None if nothing waits."""
        waits: list[float] = []
        due = self.keyed.next_due(lane, now)
        if due is not None:
            waits.append(due - now)
        if not self.breaker.allows() and not self.drained(lane):
            waits.append(self.breaker.remaining())
        return min(waits, default=None)

    def sends(self, batch: Batch) -> Iterator[Send]:
        """The batch's messages by engine, as long as the broker is not cooling down."""
        for part in by_engine(batch):
            if self.breaker.allows():
                yield part
            elif self.retry_for and not self.closing:
                self.requeue(batch.lane, part.engine, part.plain)
                self.keyed.put_back(batch.lane, part.keyed)
            else:
                _log_skipped(len(part.plain) + len(part.keyed), "broker recently unavailable")

    def ordered(
        self, lane: int, engine: Engine, keyed: list[Keyed], check: OrderCheck | QmqError
    ) -> list[OutgoingMessage]:
        """The keyed messages that may go now, in outbox id order. Held-back ones go back
        to the lane for another try (the compensator's after ``max_holds``); those already
        sent or dead are dropped; all of them, if the check itself failed."""
        if isinstance(check, QmqError):
            self._database(engine).failed(check)
            return []
        ready = [entry for entry in keyed if entry.message.id in check.sendable]
        ready.sort(key=lambda entry: check.sendable[entry.message.id])
        held = [entry for entry in keyed if entry.message.id in check.held]
        if held:
            self._hold(lane, held)
        return [entry.message for entry in ready]

    def _hold(self, lane: int, held: list[Keyed]) -> None:
        now = time.monotonic()
        again: list[Keyed] = []
        for entry in held:
            entry.holds += 1
            if entry.holds <= self.max_holds:
                entry.due = now + self.hold_delay * 2 ** (entry.holds - 1)
                again.append(entry)
        self.keyed.put_back(lane, again)
        _log_held(len(held), len(held) - len(again))

    def completion(self, report: SendReport) -> dict[str, Any]:
        """Learn from a send (a failure opens the breaker); the store's ``mark_dispatched``
        arguments for its rows: sent ones, and rejected ones dead. Unroutable ones stay
        pending for the compensator."""
        if report.error is not None:
            self.breaker.open(self.broker.failed(report.error))
        elif report.results or report.rejected or report.unroutable:
            self.broker.succeeded()
        for subject, count, reason in _by_subject(report):
            self.unroutable.note(subject, count, reason, "left to the compensator")
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


def _by_subject(report: SendReport) -> list[tuple[str, int, str]]:
    found: dict[str, tuple[int, str]] = {}
    for message, error in report.unroutable:
        count, _ = found.get(message.subject, (0, ""))
        found[message.subject] = (count + 1, str(error))
    return [(subject, count, reason) for subject, (count, reason) in found.items()]


def _count(report: SendReport) -> int:
    return len(report.results) + len(report.rejected) + len(report.unsent)


def _log_drain_timeout(drain_timeout: float, left: int) -> None:
    logger.warning(
        "dispatcher did not drain within %.1fs; the rest stays pending",
        drain_timeout,
        extra={"action": "outbox.drain_timeout", "left": left},
    )


Client = TypeVar("Client", Producer, AsyncProducer)


class _Driver(Generic[Client]):
    """The settings of both drivers: ``senders`` send at once, named ``<name>-<n>``, each
    with its lane of keyed messages. ``client`` is a transport's producer (a
    ``BrokerClient`` or ``AsyncBrokerClient`` for the qmq broker).

    After a failed send, nothing is sent for ``cooldown`` seconds, doubling with each failure
    in a row up to ``max_cooldown``; meanwhile messages younger than ``retry_for`` seconds
    wait for the next try (0: they go straight to the compensator). An outage is summarised
    in the log every ``outage_summary_interval`` seconds. A keyed message held back by an
    earlier row of its key is tried again after ``hold_delay`` seconds, doubling, up to
    ``max_holds`` times.
    """

    def __init__(
        self,
        client: Client,
        *,
        capacity: int = 10_000,
        batch_size: int = 500,
        senders: int = 2,
        cooldown: float = 1.0,
        max_cooldown: float = 5.0,
        outage_summary_interval: float = DEFAULT_SUMMARY_INTERVAL,
        name: str = DEFAULT_NAME,
        hold_delay: float = HOLD_DELAY,
        max_holds: int = MAX_HOLDS,
        retry_for: float = 0.0,
    ) -> None:
        self._client: Client = client
        self._senders = max(1, senders)
        self._dispatch = Dispatch(
            capacity=capacity,
            batch_size=batch_size,
            cooldown=cooldown,
            max_cooldown=max_cooldown,
            target=client_url(client),
            outage_summary_interval=outage_summary_interval,
            lanes=self._senders,
            hold_delay=hold_delay,
            max_holds=max_holds,
            retry_for=retry_for,
        )
        self._name = name
        self._setup()

    def _setup(self) -> None:
        """The driver's own state."""

    def _sender_name(self, lane: int) -> str:
        return f"{self._name}-{lane + 1}"


class Marks:
    """Sent marks gathered from the sender threads and written by one thread of its own
    (``<name>-marks``): every ``interval`` seconds, or once ``limit`` ids wait, one
    ``mark_dispatched`` per engine; then ``settled(engine, report, marked)`` for each send.
    """

    def __init__(
        self,
        *,
        name: str,
        interval: float,
        limit: int,
        store: Callable[[Engine], OutboxStore],
        settled: Callable[[Engine, SendReport, int | QmqError], None],
    ) -> None:
        self._name = name
        self._interval = interval
        self._limit = limit
        self._store = store
        self._settled = settled
        self._cond = threading.Condition()
        self._waiting: dict[Engine, list[SendReport]] = {}
        self._count = 0
        self._closing = False
        self._thread: threading.Thread | None = None

    def add(self, engine: Engine, report: SendReport) -> None:
        """Mark ``report``'s sent messages within ``interval`` seconds."""
        with self._cond:
            self._waiting.setdefault(engine, []).append(report)
            self._count += len(report.results)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if self._count >= self._limit:
                self._cond.notify()

    def close(self, timeout: float) -> bool:
        """Write what waits and stop; True if done within ``timeout``."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self) -> None:
        try:
            while batch := self._next():
                for engine, reports in batch.items():
                    self._mark(engine, reports)
        except BaseException:
            logger.critical(
                "dispatcher marker died; sent rows it held stay pending (resent, deduplicated)",
                exc_info=True,
                extra={"action": "outbox.dispatcher_died"},
            )
            raise

    def _next(self) -> dict[Engine, list[SendReport]]:
        """The marks to write now; empty once closing and nothing waits."""
        with self._cond:
            while not self._waiting and not self._closing:
                self._cond.wait()
            deadline = time.monotonic() + self._interval
            while self._count < self._limit and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._waiting, self._count = self._waiting, {}, 0
            return batch

    def _mark(self, engine: Engine, reports: list[SendReport]) -> None:
        sent_ids = [result.id for report in reports for result in report.results]
        try:
            self._store(engine).mark_dispatched(sent_ids=sent_ids, dead=[], now=utcnow())
        except QmqError as exc:
            for report in reports:
                self._settled(engine, report, exc)
            return
        for report in reports:
            self._settled(engine, report, len(report.results))


class ThreadDispatcher(_Driver[Producer]):
    """Background senders for sync engines, started by the first ``submit()``.

    ``senders`` threads (named ``<name>-<n>``) take unkeyed messages from one backlog, so a
    batch can go out while another waits for the broker's durable answer; batches of
    different transactions may therefore be stored in either order. Keyed messages go by
    lanes, one per thread, and keep their key's order. A send of unkeyed messages only is
    marked by ``Marks`` within ``MARK_INTERVAL`` seconds, the others at once.
    """

    def _setup(self) -> None:
        self._marks = Marks(
            name=f"{self._name}-marks",
            interval=MARK_INTERVAL,
            limit=MARK_BATCH,
            store=self._store,
            settled=self._dispatch.settled,
        )
        self._cond = threading.Condition()
        self._abandon = False
        self._threads: list[threading.Thread | None] = [None] * self._senders
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
            for lane, thread in enumerate(self._threads):
                if thread is None or not thread.is_alive():
                    thread = threading.Thread(
                        target=self._run, args=(lane,), name=self._sender_name(lane), daemon=True
                    )
                    thread.start()
                    self._threads[lane] = thread
            if any(message.key is not None for message in messages):
                self._cond.notify_all()  # its lane's sender must be among those woken
            else:
                self._cond.notify()
            return True

    def close(self, drain_timeout: float = 10.0) -> bool:
        """Stop taking messages, send what is queued; True if drained within ``drain_timeout``."""
        with self._cond:
            self._dispatch.closing = True
            self._cond.notify_all()
            threads = [thread for thread in self._threads if thread is not None]
        deadline = time.monotonic() + drain_timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            with self._cond:
                self._abandon = True
                self._cond.notify_all()
            _log_drain_timeout(drain_timeout, self._dispatch.queued)
            self._marks.close(max(0.0, deadline - time.monotonic()))
            return False
        return self._marks.close(max(0.0, deadline - time.monotonic()))

    def _run(self, lane: int) -> None:
        try:
            while batch := self._next_batch(lane):
                for part in self._dispatch.sends(batch):
                    messages = part.plain
                    if part.keyed:
                        check = self._check(part)
                        with self._cond:
                            ready = self._dispatch.ordered(lane, part.engine, part.keyed, check)
                        messages = messages + ready
                    if messages:
                        self._send(lane, part.engine, messages)
        except BaseException:
            logger.critical(
                "dispatcher thread died; committed messages now wait for the compensator",
                exc_info=True,
                extra={"action": "outbox.dispatcher_died"},
            )
            raise

    def _check(self, part: Send) -> OrderCheck | QmqError:
        try:
            return self._store(part.engine).order_check(
                message_ids=[entry.message.id for entry in part.keyed]
            )
        except QmqError as exc:
            return exc

    def _send(self, lane: int, engine: Engine, messages: list[OutgoingMessage]) -> None:
        with tracing.sending("qmq send", messages) as traced:
            report = traced(send(self._client, messages))
        with self._cond:
            completion = self._dispatch.completion(report)
            self._dispatch.requeue(lane, engine, report.unsent)
        if report.results and not report.rejected and all(m.key is None for m in messages):
            self._marks.add(engine, report)
            return
        try:
            marked: int | QmqError = self._store(engine).mark_dispatched(**completion)
        except QmqError as exc:
            marked = exc
        self._dispatch.settled(engine, report, marked)

    def _next_batch(self, lane: int) -> Batch:
        """Lane ``lane``'s next batch; empty once closed and drained (or abandoned)."""
        with self._cond:
            while not self._abandon:
                now = time.monotonic()
                batch = self._dispatch.take(lane, now)
                if batch or (self._dispatch.closing and self._dispatch.drained(lane)):
                    return batch
                self._cond.wait(self._dispatch.wait_time(lane, now))
            return Batch(lane)

    def _store(self, engine: Engine) -> OutboxStore:
        with self._cond:
            store = self._stores.get(engine)
            if store is None:
                store = self._stores[engine] = OutboxStore(engine)
            return store


class AsyncDispatcher(_Driver[AsyncProducer]):
    """Background senders for asyncio engines: ``senders`` tasks on the loop that
    ``submit()`` runs on, taking unkeyed messages from one backlog and keyed ones from
    their own lanes."""

    def _setup(self) -> None:
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None] | None] = [None] * self._senders
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
        for lane, task in enumerate(self._tasks):
            if task is None or task.done():
                task = loop.create_task(self._run(lane), name=self._sender_name(lane))
                task.add_done_callback(_report_death)
                self._tasks[lane] = task
        self._wake.set()
        return True

    async def aclose(self, drain_timeout: float = 10.0) -> bool:
        """Stop taking messages, send what is queued; True if drained within ``drain_timeout``."""
        self._dispatch.closing = True
        tasks = [task for task in self._tasks if task is not None]
        if not tasks:
            return True
        self._wake.set()
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
        if pending:
            for task in pending:
                task.cancel()
            _log_drain_timeout(drain_timeout, self._dispatch.queued)
            return False
        return True

    async def _run(self, lane: int) -> None:
        while batch := await self._next_batch(lane):
            for part in self._dispatch.sends(batch):
                messages = part.plain
                if part.keyed:
                    check = await self._check(part)
                    messages = messages + self._dispatch.ordered(
                        lane, part.engine, part.keyed, check
                    )
                if messages:
                    await self._send(lane, part.engine, messages)

    async def _check(self, part: Send) -> OrderCheck | QmqError:
        try:
            return await self._store(part.engine).order_check(
                message_ids=[entry.message.id for entry in part.keyed]
            )
        except QmqError as exc:
            return exc

    async def _send(self, lane: int, engine: Engine, messages: list[OutgoingMessage]) -> None:
        with tracing.sending("qmq send", messages) as traced:
            report = traced(await send_async(self._client, messages))
        completion = self._dispatch.completion(report)
        self._dispatch.requeue(lane, engine, report.unsent)
        try:
            marked: int | QmqError = await self._store(engine).mark_dispatched(**completion)
        except QmqError as exc:
            marked = exc
        self._dispatch.settled(engine, report, marked)

    async def _next_batch(self, lane: int) -> Batch:
        while True:
            now = time.monotonic()
            batch = self._dispatch.take(lane, now)
            if batch or (self._dispatch.closing and self._dispatch.drained(lane)):
                return batch
            self._wake.clear()  # one loop thread: no wake-up can slip in between
            try:
                await asyncio.wait_for(self._wake.wait(), self._dispatch.wait_time(lane, now))
            except TimeoutError:
                pass  # a held message is due

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
