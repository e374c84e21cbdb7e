"""``AsyncDispatcher``: ``Dispatch`` run by named tasks on the application's event loop,
for asyncio engines."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence

from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from qmq_outbox import tracing
from qmq_outbox.dispatcher.driver import Driver
from qmq_outbox.dispatcher.logs import log_drain_timeout, logger
from qmq_outbox.dispatcher.queues import Batch, Send
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import QmqError
from qmq_outbox.sending import send_async
from qmq_outbox.store import AsyncOutboxStore, OrderCheck
from qmq_outbox.transports.base import AsyncProducer


class AsyncDispatcher(Driver[AsyncProducer]):
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
            log_drain_timeout(drain_timeout, self._dispatch.queued)
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
