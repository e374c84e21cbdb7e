"""``ThreadDispatcher``: ``Dispatch`` run by named daemon threads for sync engines, with
``Marks``, the thread that marks the senders' unkeyed sends ``sent`` in batches."""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from sqlalchemy.engine import Engine

from qmq_outbox import tracing
from qmq_outbox.dispatcher.driver import Driver
from qmq_outbox.dispatcher.logs import log_drain_timeout, logger
from qmq_outbox.dispatcher.queues import Batch, Send
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import QmqError
from qmq_outbox.sending import SendReport, send
from qmq_outbox.store import OrderCheck, OutboxStore, utcnow
from qmq_outbox.transports.base import Producer

MARK_INTERVAL = 0.05
MARK_BATCH = 1000


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class Marks:
    """Sent marks gathered from the sender threads and written by one thread of its own
    (``<name>-marks``): every ``interval`` seconds, or once ``limit`` ids wait, one
    ``mark_dispatched`` per engine; then ``settled(engine, report, marked)`` for each send.
    """

    name: str
    interval: float
    limit: int
    store: Callable[[Engine], OutboxStore]
    settled: Callable[[Engine, SendReport, int | QmqError], None]
    _cond: threading.Condition = dataclasses.field(init=False, default_factory=threading.Condition)
    _waiting: dict[Engine, list[SendReport]] = dataclasses.field(init=False, default_factory=dict)
    _count: int = dataclasses.field(init=False, default=0)
    _closing: bool = dataclasses.field(init=False, default=False)
    _thread: threading.Thread | None = dataclasses.field(init=False, default=None)

    def add(self, engine: Engine, report: SendReport) -> None:
        """Mark ``report``'s sent messages within ``interval`` seconds."""
        with self._cond:
            self._waiting.setdefault(engine, []).append(report)
            self._count += len(report.results)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            if self._count >= self.limit:
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
            deadline = time.monotonic() + self.interval
            while self._count < self.limit and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._waiting, self._count = self._waiting, {}, 0
            return batch

    def _mark(self, engine: Engine, reports: list[SendReport]) -> None:
        sent_ids = [result.id for report in reports for result in report.results]
        try:
            self.store(engine).mark_dispatched(sent_ids=sent_ids, dead=[], now=utcnow())
        except QmqError as exc:
            for report in reports:
                self.settled(engine, report, exc)
            return
        for report in reports:
            self.settled(engine, report, len(report.results))


class ThreadDispatcher(Driver[Producer]):
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
            log_drain_timeout(drain_timeout, self._dispatch.queued)
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
