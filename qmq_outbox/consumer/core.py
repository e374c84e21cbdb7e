"""``Consumer``: pull messages of some subjects for one group and run their handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from qmq_outbox.calls import Position, PullMode
from qmq_outbox.client import BrokerClient
from qmq_outbox.consumer.clients import OnThreads, PullClient, is_async_client
from qmq_outbox.consumer.config import ConsumerConfig, ConsumerStats, Counters
from qmq_outbox.consumer.handlers import (
    AsyncSessionHandler,
    Guard,
    HandlerSpec,
    MessageHandler,
    SessionHandler,
)
from qmq_outbox.consumer.runner import Runner
from qmq_outbox.consumer.signals import stop_on_signals
from qmq_outbox.consumer.threads import ThreadPool
from qmq_outbox.errors import ConfigurationError, ConsumerCrashed, UnsupportedByTransport
from qmq_outbox.transports.base import ConsumerSpec, Transport
from qmq_outbox.transports.qmq import CAPABILITIES as QMQ_CAPABILITIES
from qmq_outbox.transports.urls import from_url
from qmq_wire import MAX_KEYS_IN_FLIGHT, rules

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from qmq_outbox.idempotent import IdempotentStore, NonTransactional

logger = logging.getLogger(__name__)

H = TypeVar("H", bound=MessageHandler)
HS = TypeVar("HS", bound=SessionHandler)
HA = TypeVar("HA", bound=AsyncSessionHandler)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def generate_consumer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Consumer:
    """Consume one group's messages of the subjects that have a ``@handler``.

    A handler that returns acks its message (acks are batched: ``ack_batch_size`` or
    ``ack_interval`` seconds, and flushed on stop); one that raises nacks it, and the broker
    retries with its backoff; ``RetryLater(delay)`` chooses the delay. At most
    ``concurrency`` handlers run at once and at most ``concurrency + prefetch`` messages are
    leased to this consumer at any time, so a slow handler does not hoard the group's
    messages. ``mode="broadcast"`` gives every consumer of the group every message.
    ``start`` is where a group new to a subject begins: ``"earliest"``, ``"latest"``, or on
    the qmq broker ``{"seq": n}`` or ``{"time": "<RFC 3339>"}`` (replay into a new group).
    ``@handler(subject, ordered=True)`` consumes an ordered subject key by key, up to
    ``ordered_keys`` keys in flight per partition (default ``2 * concurrency``; 1: one
    batch per partition at a time) (``docs/consumer.md``, "Ordered handlers").

    ``transport`` is where the messages come from (docs/transports.md): the qmq broker
    (``QmqTransport``), NATS JetStream or RabbitMQ; ``broker_url`` is its short form, the
    scheme picking the transport (``http://``, ``nats://``, ``amqp://``; ``token`` for the
    qmq broker). Broadcast mode and ordered handlers are the qmq broker's alone
    (``UnsupportedByTransport`` elsewhere). ``client`` is an injected ``BrokerClient`` (for
    ``run()``) or ``AsyncBrokerClient`` (for ``run_async()``), or anything with their
    ``pull/ack/nack/ack_and_pull``; the consumer does not close what it was given. While
    the broker is down the consumer logs it once, a summary every ``outage_summary``
    seconds, and once when it is back.
    """

    def __init__(
        self,
        broker_url: str | None = None,
        group: str = "",
        *,
        transport: Transport | None = None,
        consumer_id: str | None = None,
        concurrency: int = 8,
        prefetch: int | None = None,
        max_batch: int = 32,
        wait_ms: int = 5000,
        ack_batch_size: int = 100,
        ack_interval: float = 0.05,
        mode: PullMode = "shared",
        start: Position = "earliest",
        shutdown_timeout: float = 30.0,
        token: str | None = None,
        client: BrokerClient | PullClient | None = None,
        outage_summary: float = 60.0,
        ordered_keys: int | None = None,
    ) -> None:
        if concurrency < 1 or max_batch < 1 or ack_batch_size < 1:
            raise ConfigurationError("concurrency, max_batch and ack_batch_size must be >= 1")
        if ordered_keys is not None and not 1 <= ordered_keys <= MAX_KEYS_IN_FLIGHT:
            raise ConfigurationError(f"ordered_keys must be 1..{MAX_KEYS_IN_FLIGHT}")
        if not 0 <= wait_ms <= 60_000 or max_batch > 1000:
            raise ConfigurationError("wait_ms must be 0..60000 and max_batch at most 1000")
        if mode not in ("shared", "broadcast") or rules.Position.of(start) is None:
            raise ConfigurationError(f"bad mode {mode!r} or start {start!r}")
        if not group or len(group) > 200:
            raise ConfigurationError("group must be 1..200 characters")
        if transport is None and client is None:
            if broker_url is None:
                raise ConfigurationError("Consumer needs transport= or broker_url= (or client=)")
            transport = from_url(broker_url, token=token)
        self.transport = transport
        self._capabilities = QMQ_CAPABILITIES if transport is None else transport.capabilities
        if start not in ("earliest", "latest") and self._capabilities is not QMQ_CAPABILITIES:
            raise UnsupportedByTransport(
                f"{type(transport).__name__} starts a group at earliest or latest only"
            )
        if mode == "broadcast" and not self._capabilities.broadcast:
            raise UnsupportedByTransport(
                f"{type(transport).__name__} has no broadcast mode: give each consumer a "
                "group of its own instead"
            )
        self.broker_url = broker_url or (transport.url if transport is not None else "")
        self.config = ConsumerConfig(
            group=group,
            consumer_id=consumer_id or generate_consumer_id(),
            concurrency=concurrency,
            prefetch=concurrency if prefetch is None else max(0, prefetch),
            max_batch=max_batch,
            wait_ms=wait_ms,
            ack_batch_size=ack_batch_size,
            ack_interval=ack_interval,
            mode=mode,
            start=start,
            shutdown_timeout=shutdown_timeout,
            outage_summary=outage_summary,
            ordered_keys=ordered_keys,
        )
        self._client = client
        self._specs: dict[str, HandlerSpec] = {}
        self._counters = Counters()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_stop: asyncio.Event | None = None
        self._running = False

    @property
    def group(self) -> str:
        return self.config.group

    @property
    def consumer_id(self) -> str:
        return self.config.consumer_id

    @property
    def subjects(self) -> list[str]:
        return sorted(self._specs)

    def stats(self) -> ConsumerStats:
        return self._counters.snapshot()

    # -- registration -----------------------------------------------------------------

    @overload
    def handler(
        self,
        subject: str,
        *,
        idempotent: None = None,
        ordered: bool = False,
        tags: Sequence[str] | None = None,
    ) -> Callable[[H], H]: ...

    @overload
    def handler(
        self,
        subject: str,
        *,
        idempotent: IdempotentStore[Session],
        ordered: bool = False,
        tags: Sequence[str] | None = None,
    ) -> Callable[[HS], HS]: ...

    @overload
    def handler(
        self,
        subject: str,
        *,
        idempotent: IdempotentStore[AsyncSession],
        ordered: bool = False,
        tags: Sequence[str] | None = None,
    ) -> Callable[[HA], HA]: ...

    @overload
    def handler(
        self,
        subject: str,
        *,
        idempotent: NonTransactional[Any],
        ordered: bool = False,
        tags: Sequence[str] | None = None,
    ) -> Callable[[H], H]: ...

    def handler(
        self,
        subject: str,
        *,
        idempotent: Guard | None = None,
        ordered: bool = False,
        tags: Sequence[str] | None = None,
    ) -> Callable[[Any], Any]:
        """Register the decorated function for ``subject`` (returned unchanged).

        ``idempotent=store`` runs it as ``handler(message, session)`` in one transaction
        with the dedup row; ``idempotent=store.non_transactional()`` as
        ``handler(message)`` between a *processing* claim and *done*.

        ``ordered=True`` for an ordered subject (declared with partitions): its messages are
        pulled in ``"ordered"`` mode, one key's run strictly one after another in seq
        order, different keys' concurrently (up to ``concurrency``). A failure nacks that
        message and the key's later ones of the same batch together, unrun (an attempt
        counted for the failed one only).
        A store then commits one message per transaction (its ``batch_size`` is not used).

        ``tags=[...]``: the group takes only messages with any of these tags. The qmq broker
        skips the rest for the group (no lease, no ack; its ``filtered`` count); the
        filter is fixed by the group's first pull, so every consumer of the group must
        pass the same one (409 ``tags_conflict`` otherwise). A transport that cannot filter
        (JetStream, RabbitMQ) delivers them and the consumer acks them unrun
        (``stats().filtered``). Not with ``ordered=True``.
        """

        def register(fn: Any) -> Any:
            self.add_handler(subject, fn, idempotent=idempotent, ordered=ordered, tags=tags)
            return fn

        return register

    def add_handler(
        self,
        subject: str,
        fn: Callable[..., Any],
        *,
        idempotent: Guard | None = None,
        ordered: bool = False,
        tags: Sequence[str] | None = None,
    ) -> None:
        """The non-decorator form of ``handler``."""
        if self._running:
            raise ConfigurationError("handlers must be registered before run()")
        if subject in self._specs:
            raise ConfigurationError(f"subject {subject!r} already has a handler")
        if ordered and not self._capabilities.ordered:
            raise UnsupportedByTransport(
                f"{type(self.transport).__name__} has no ordered subjects: ordered handlers "
                "need the qmq broker (docs/transports.md)"
            )
        if ordered and self.config.mode != "shared":
            raise ConfigurationError(
                "ordered handlers need a shared-mode consumer: an ordered subject hands each "
                "partition to one consumer of the group at a time"
            )
        spec = HandlerSpec(
            subject=subject, fn=fn, guard=idempotent, ordered=ordered, tags=tuple(tags or ())
        )
        spec.validate()
        self._specs[subject] = spec

    # -- running ----------------------------------------------------------------------

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Consume until ``stop()`` (or SIGTERM/SIGINT), then stop gracefully: stop
        pulling, finish what was pulled within ``shutdown_timeout``, flush acks.

        Blocks the calling thread, which runs the consumer's event loop (``asyncio.run``);
        plain handlers run on ``concurrency`` handler threads. Signal handlers are installed
        only from the main thread. Raises ``ConsumerCrashed`` when a consumer loop died.
        """
        for spec in self._specs.values():
            spec.check_threaded()
        if self._client is not None and is_async_client(self._client):
            raise ConfigurationError("run() needs a BrokerClient; use run_async() for this one")
        if _loop_running():
            raise ConfigurationError("run() blocks: on an event loop, await run_async()")
        asyncio.run(self._serve(install_signal_handlers))

    async def run_async(self, *, install_signal_handlers: bool = True) -> None:
        """``run()`` on the running event loop, as tasks."""
        if self._client is not None and not is_async_client(self._client):
            raise ConfigurationError("run_async() needs an AsyncBrokerClient")
        await self._serve(install_signal_handlers)

    async def _serve(self, install_signal_handlers: bool) -> None:
        if not self._specs:
            raise ConfigurationError("no handlers registered")
        if self._running:
            raise ConfigurationError("this consumer is already running")
        self._running = True
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        self._loop, self._async_stop = loop, stop
        if self._stop.is_set():  # stop() was called before the loop knew the event
            stop.set()
        try:
            async with contextlib.AsyncExitStack() as resources:
                runner = Runner(
                    config=self.config,
                    specs=dict(self._specs),
                    client=await self._open_client(resources),
                    counters=self._counters,
                    stop=stop,
                    tag_filter=self._capabilities.tag_filter,
                )
                with stop_on_signals(loop, install_signal_handlers, self._on_signal):
                    runner.start()
                    await stop.wait()
                    await runner.shutdown()
        finally:
            self._running = False
            self._loop = self._async_stop = None
            self._stop.clear()  # a later run() starts afresh; a stop() before run() is kept
        if runner.fatal is not None:
            raise ConsumerCrashed(f"consumer {self.consumer_id} crashed") from runner.fatal

    async def _open_client(self, resources: contextlib.AsyncExitStack) -> PullClient:
        """The injected client (a blocking one runs on threads of its own), or the
        transport's."""
        injected = self._client
        if injected is not None and is_async_client(injected):
            return cast(PullClient, injected)
        # One connection (or client thread) per puller, per handler's nack, and the acker.
        connections = len(self._specs) + self.config.concurrency + 1
        if injected is not None:
            threads = ThreadPool(connections, name=f"qmq-consumer[{self.group}]-client")
            threads.start()
            resources.callback(threads.close)
            return OnThreads(cast(BrokerClient, injected), threads)  # or any client with its calls
        assert self.transport is not None  # the constructor saw to it
        spec = ConsumerSpec(
            group=self.group,
            consumer_id=self.consumer_id,
            subjects=tuple(sorted(self._specs)),
            start=self.config.start,
            capacity=self.config.capacity,
            connections=connections,
        )
        own = await self.transport.open_consumer(spec)
        resources.push_async_callback(own.aclose)
        return own

    def _on_signal(self, signum: int) -> None:
        logger.info(
            "signal received; stopping", extra={"action": "consumer.signal", "signal": signum}
        )
        self.stop()

    def stop(self) -> None:
        """Ask a running consumer to stop gracefully; ``run()`` returns once it has.

        Safe from any thread. (Not from your own signal handler: let ``run()`` install its.)
        """
        self._stop.set()
        loop, event = self._loop, self._async_stop
        if loop is None or event is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop already closed
                pass
