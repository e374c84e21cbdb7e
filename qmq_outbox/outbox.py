"""``Outbox``: publish messages inside the caller's SQLAlchemy transaction (see docs/outbox.md).

``publish()`` stages the message and its ``qmq_outbox`` row on the caller's session's current
transaction; the row goes in through the session's connection at its next flush, or right
before COMMIT at the latest. After the outermost commit the staged messages go to
a background dispatcher (a thread for sync engines, a task on the running loop for asyncio
engines) that sends them and marks their rows ``sent``; anything it cannot do is left to the
compensator. The caller owns the transaction: nothing here begins, flushes or commits it.
``run_compensator()`` runs that compensator inside the process, for apps of one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, Unpack, overload

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import tracing
from qmq_outbox.compensator.config import CompensatorConfig, CompensatorSettings
from qmq_outbox.dburl import sync_database_url
from qmq_outbox.dispatcher import AsyncDispatcher, ThreadDispatcher
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import ConfigurationError, UnsupportedByTransport
from qmq_outbox.rows import insert_rows, row_values
from qmq_outbox.schema import outbox_table
from qmq_outbox.serializers import JsonSerializer, Serializer, serialize
from qmq_outbox.store import utcnow
from qmq_outbox.tracking import TransactionTracker, engine_of
from qmq_outbox.transports.base import (
    AsyncProducer,
    ClosingAsyncProducer,
    ClosingProducer,
    Producer,
    Transport,
)
from qmq_outbox.transports.qmq import CAPABILITIES as QMQ_CAPABILITIES
from qmq_outbox.transports.urls import from_url
from qmq_outbox.uuid7 import uuid7_str
from qmq_outbox.validation import (
    check_headers,
    check_key,
    check_message_id,
    check_subject,
    check_tags,
    resolve_deliver_at,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from qmq_outbox.compensator import Compensator

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound=Session)
AS = TypeVar("AS", bound=AsyncSession)


@dataclasses.dataclass(frozen=True, slots=True)
class Staged:
    """A published message, the bind its row goes through and the row's values."""

    message: OutgoingMessage
    bind: Engine | Connection
    row: Mapping[str, Any]  # its outbox row's values (``row_values``)


class Outbox:
    """Transactional publishing for one application; see the module docstring.

    ``transport`` is where the dispatcher sends (docs/transports.md): the qmq broker
    (``QmqTransport``), NATS JetStream or RabbitMQ. ``broker_url`` is the short form, its
    scheme picking the transport (``http://`` the qmq broker, ``nats://``, ``amqp://``);
    ``client``/``async_client`` inject a producer (a ``BrokerClient``/``AsyncBrokerClient``)
    that the outbox does not close. ``app`` is the envelope's ``producer``.
    ``dispatch=False`` leaves every message to the compensator. ``queue_size`` bounds the
    messages waiting for the dispatcher (beyond it they are left to the compensator);
    ``senders`` batches may be in flight at once. ``retry_for``: seconds after its publish
    during which the dispatcher keeps a message the broker could not take and sends it once
    the broker is back; keep it below the compensator's ``grace`` (30 s by default), which
    takes over after it (0 leaves such messages to the compensator at once).
    """

    def __init__(
        self,
        *,
        broker_url: str | None = None,
        transport: Transport | None = None,
        app: str | None = None,
        token: str | None = None,
        serializer: Serializer | None = None,
        client: Producer | None = None,
        async_client: AsyncProducer | None = None,
        dispatch: bool = True,
        queue_size: int = 10_000,
        batch_size: int = 500,
        senders: int = 2,
        dispatcher_name: str = "qmq-outbox-dispatcher",
        outage_summary: float = 60.0,
        retry_for: float = 20.0,
    ) -> None:
        if transport is None and broker_url is not None:
            transport = from_url(broker_url, token=token)
        if dispatch and transport is None and client is None and async_client is None:
            raise ConfigurationError(
                "Outbox needs transport= or broker_url= (or a client) to dispatch"
            )
        self.app = app
        self.transport = transport
        self._capabilities = QMQ_CAPABILITIES if transport is None else transport.capabilities
        self._serializer = serializer or JsonSerializer()
        self._client = client
        self._async_client = async_client
        self._outage_summary = outage_summary
        self._dispatch = dispatch
        self._queue_size = queue_size
        self._batch_size = batch_size
        self._senders = senders
        self._name = dispatcher_name
        self._retry_for = retry_for
        self._compensators: list[tuple[Compensator, sa.Engine | None]] = []
        self._tracker: TransactionTracker[Staged] = TransactionTracker(
            self._on_commit, write=self._write_rows
        )
        self._lock = threading.Lock()
        self._thread_dispatcher: ThreadDispatcher | None = None
        self._owned_client: ClosingProducer | None = None
        self._loop_dispatchers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[AsyncDispatcher, ClosingAsyncProducer | None]
        ] = weakref.WeakKeyDictionary()

    # -- wiring -----------------------------------------------------------------------------

    def install(self, target: object) -> None:
        """Hook the outbox into ``target``'s sessions; safe to call more than once.

        ``target``: an ``Engine`` or ``AsyncEngine``, covering every session bound to it
        however it is created (``Session(engine)``, ``AsyncSession(engine)``, any
        sessionmaker, a connection of it); or a ``sessionmaker``, a ``scoped_session``, a
        ``Session`` subclass or instance, or an ``async_sessionmaker`` (one without a
        ``sync_session_class`` stands for the engine it is bound to). Installing an engine
        puts its listeners on the ``Session`` class that act only on sessions this
        outbox staged messages on; sessions bound to other engines are refused by
        ``publish`` and never touched.
        """
        self._tracker.install(target)

    def uninstall(self, target: object) -> None:
        """Undo ``install(target)``; messages already staged are left to the compensator."""
        self._tracker.uninstall(target)

    # -- publishing -------------------------------------------------------------------------

    def publish(
        self,
        session: Session | AsyncSession,
        subject: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
        delay: timedelta | None = None,
        deliver_at: datetime | None = None,
        tags: Sequence[str] | None = None,
    ) -> str:
        """Stage the message and its outbox row on ``session``; returns the message id.

        The caller owns the transaction: this never flushes or commits ``session`` (it
        autobegins it, as adding an object does). The row goes in at the session's next
        flush, or right before COMMIT (or a savepoint's RELEASE) at the latest.
        The message is sent only if (and after) the outermost transaction commits; a
        rollback, a rolled-back savepoint or a close without commit discards it. ``body`` is
        serialized with the outbox's serializer (JSON by default); ``bytes`` pass unchanged.
        Works the same (without ``await``) for an ``AsyncSession``.

        Messages with the same ``key`` (and subject) are sent in the order of their outbox
        ids; on PostgreSQL the flush of a keyed row locks its key until the transaction ends,
        so those ids follow the commits (docs/outbox.md, "Per-key order"). A delay needs a
        transport that can delay (``UnsupportedByTransport`` otherwise). ``tags``: at most
        ``qmq_wire.MAX_TAGS`` distinct tags (``qmq_wire.TAG_PATTERN``) that consumer groups
        filter on (``InvalidMessage`` otherwise).
        """
        sync = session.sync_session if isinstance(session, AsyncSession) else session
        bind = self._installed_bind(sync)
        now = utcnow()
        due = resolve_deliver_at(now, delay, deliver_at)
        if due is not None and not self._capabilities.delay:
            raise UnsupportedByTransport(
                f"{type(self.transport).__name__} cannot delay messages (no scheduled "
                "delivery): publish without delay/deliver_at, or use the qmq broker"
            )
        payload, content_type = serialize(body, self._serializer)
        message = OutgoingMessage(
            id=check_message_id(message_id) if message_id is not None else uuid7_str(),
            subject=check_subject(subject),
            body=payload,
            key=check_key(key),
            headers=check_headers(headers),
            producer=self.app,
            created_at=now,
            deliver_at=due,
            tags=check_tags(tags),
        )
        message = tracing.published(message)  # the publish span; adds its traceparent
        self._tracker.stage(sync, Staged(message, bind, row_values(message, content_type)))
        return message.id

    @staticmethod
    def _write_rows(session: Session, staged: list[Staged]) -> None:
        """The tracker's writer: the staged messages' rows, in one INSERT on the session's
        connection for the outbox table, in the transaction current now."""
        connection = session.connection(bind_arguments={"clause": outbox_table})
        insert_rows(connection, [item.row for item in staged])

    def _installed_bind(self, session: Session) -> Engine | Connection:
        """The bind the outbox row is written through; refuses sessions not installed on."""
        try:
            bind = session.get_bind(clause=outbox_table)
        except UnboundExecutionError as exc:
            raise ConfigurationError(
                "this session is bound to no engine: create it with Session(engine) or a "
                "sessionmaker bound to one, and call outbox.install(engine)"
            ) from exc
        if not self._tracker.is_installed(session, bind):
            raise ConfigurationError(
                f"no outbox installed for this session (bound to {engine_of(bind)!r}): call "
                "outbox.install(engine) with that engine, or install its sessionmaker"
            )
        return bind

    @overload
    def transactional(
        self, maker: async_sessionmaker[AS]
    ) -> Callable[
        [Callable[Concatenate[AS, P], Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]
    ]: ...

    @overload
    def transactional(
        self, maker: sessionmaker[S]
    ) -> Callable[[Callable[Concatenate[S, P], R]], Callable[P, R]]: ...

    def transactional(self, maker: Any) -> Any:
        """Decorate ``fn(session, ...)``: run it in a new transaction of ``maker``.

        The session is injected as the first argument; the transaction commits when ``fn``
        returns and rolls back (re-raising) when it raises. Async functions need an
        ``async_sessionmaker``. Installs the outbox on ``maker`` if not done yet.
        """
        self.install(maker)
        if isinstance(maker, async_sessionmaker):
            return functools.partial(_async_transactional, maker)
        return functools.partial(_sync_transactional, maker)

    # -- dispatching ------------------------------------------------------------------------

    def _on_commit(self, items: list[Staged]) -> None:
        """Runs inside the caller's commit, after COMMIT: only hands over, never blocks."""
        if not self._dispatch:
            return
        groups: dict[Engine, list[OutgoingMessage]] = {}
        external = 0
        for item in items:
            if isinstance(item.bind, Connection):
                external += 1  # joined to an outside transaction: not durable yet
            else:
                groups.setdefault(item.bind, []).append(item.message)
        if external:
            logger.debug(
                "session joined an outside transaction; the compensator sends its messages",
                extra={"action": "outbox.external_commit", "count": external},
            )
        for engine, messages in groups.items():
            try:
                dispatcher: ThreadDispatcher | AsyncDispatcher = (
                    self._loop_dispatcher() if engine.dialect.is_async else self._sync_dispatcher()
                )
            except ConfigurationError as exc:  # never raise out of the caller's commit
                logger.error(
                    "%s; %d message(s) left to the compensator",
                    exc,
                    len(messages),
                    extra={"action": "outbox.no_transport", "count": len(messages)},
                )
                continue
            if dispatcher.submit(engine, messages):
                continue
            # The dispatcher logs a broker outage itself (once); a full queue is news.
            cooling_down = dispatcher.cooling_down
            logger.log(
                logging.DEBUG if cooling_down else logging.WARNING,
                "%s; %d message(s) left to the compensator",
                "broker down moments ago" if cooling_down else "dispatcher queue full",
                len(messages),
                extra={"action": "outbox.queue_full", "count": len(messages)},
            )

    def _sync_dispatcher(self) -> ThreadDispatcher:
        with self._lock:
            if self._thread_dispatcher is None:
                client = self._client
                if client is None:
                    client = self._owned_client = self._require_transport().producer()
                self._thread_dispatcher = ThreadDispatcher(client, **self._dispatch_settings())
            return self._thread_dispatcher

    def _dispatch_settings(self) -> dict[str, Any]:
        """What both dispatchers are built with."""
        return {
            "capacity": self._queue_size,
            "batch_size": self._batch_size,
            "senders": self._senders,
            "name": self._name,
            "outage_summary_interval": self._outage_summary,
            "retry_for": self._retry_for,
        }

    def _loop_dispatcher(self) -> AsyncDispatcher:
        loop = asyncio.get_running_loop()  # commit of an AsyncSession: we are on its loop
        entry = self._loop_dispatchers.get(loop)
        if entry is None:
            owned = None
            client = self._async_client
            if client is None:
                client = owned = self._require_transport().async_producer()
            dispatcher = AsyncDispatcher(client, **self._dispatch_settings())
            entry = self._loop_dispatchers[loop] = (dispatcher, owned)
        return entry[0]

    def _require_transport(self) -> Transport:
        if self.transport is None:
            raise ConfigurationError(
                "this outbox has no transport for this kind of engine: pass transport= or "
                "broker_url=, or the client (client= for Engine, async_client= for AsyncEngine)"
            )
        return self.transport

    # -- the in-process compensator --------------------------------------------------------

    def run_compensator(
        self,
        engine: sa.Engine | AsyncEngine,
        *,
        config: CompensatorConfig | None = None,
        **settings: Unpack[CompensatorSettings],
    ) -> Compensator:
        """Start a compensator for ``engine``'s outbox in this process; ``close()`` stops it.

        For an app of one process: it resends what the dispatcher could not (a broker
        outage longer than ``retry_for``, rows committed by a process that died), claimed
        and fenced exactly as by ``qmq compensator``, on a named background thread
        (``config.name``). It sends through this outbox's transport. Other processes may
        run compensators on the same database (PostgreSQL).
        """
        from qmq_outbox.compensator import Compensator

        settled = dataclasses.replace(config or CompensatorConfig(), **settings)
        if settled.grace.total_seconds() <= self._retry_for:
            raise ConfigurationError(
                f"the compensator's grace ({settled.grace}) must exceed the outbox's "
                f"retry_for ({self._retry_for:g}s): the dispatcher may still send such rows"
            )
        owned = None
        sync_engine = engine
        if not isinstance(engine, sa.Engine):  # an AsyncEngine: the compensator blocks
            url = engine.url.render_as_string(hide_password=False)
            sync_engine = owned = sa.create_engine(sync_database_url(url), pool_pre_ping=True)
        assert isinstance(sync_engine, sa.Engine)
        if self.transport is not None:
            compensator = Compensator(engine=sync_engine, transport=self.transport, config=settled)
        elif self._client is not None:
            compensator = Compensator(engine=sync_engine, client=self._client, config=settled)
        else:
            raise ConfigurationError("run_compensator needs an outbox with transport= or client=")
        compensator.start()
        with self._lock:
            self._compensators.append((compensator, owned))
        return compensator

    def _stop_compensators(self, timeout: float) -> bool:
        with self._lock:
            running, self._compensators = self._compensators, []
        stopped = True
        for compensator, owned in running:
            stopped = compensator.stop(timeout) and stopped
            if owned is not None:
                owned.dispose()
        return stopped

    def close(self, drain_timeout: float = 10.0) -> bool:
        """Drain the thread dispatcher within ``drain_timeout`` and stop the compensators
        this outbox runs; True if nothing was left behind."""
        with self._lock:
            dispatcher, self._thread_dispatcher = self._thread_dispatcher, None
            client, self._owned_client = self._owned_client, None
        drained = dispatcher.close(drain_timeout) if dispatcher is not None else True
        if client is not None:
            client.close()
        return self._stop_compensators(drain_timeout) and drained

    async def aclose(self, drain_timeout: float = 10.0) -> bool:
        """Drain this loop's dispatcher (and the thread one, if any) within ``drain_timeout``."""
        drained = True
        entry = self._loop_dispatchers.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            dispatcher, owned = entry
            drained = await dispatcher.aclose(drain_timeout)
            if owned is not None:
                await owned.aclose()
        if self._thread_dispatcher is not None or self._compensators:
            drained = await asyncio.to_thread(self.close, drain_timeout) and drained
        return drained

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Outbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _sync_transactional(
    maker: sessionmaker[S], fn: Callable[Concatenate[S, P], R]
) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with maker.begin() as session:
            return fn(session, *args, **kwargs)

    return wrapper


def _async_transactional(
    maker: async_sessionmaker[AS], fn: Callable[Concatenate[AS, P], Awaitable[R]]
) -> Callable[P, Coroutine[Any, Any, R]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        async with maker.begin() as session:
            return await fn(session, *args, **kwargs)

    return wrapper
