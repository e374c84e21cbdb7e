"""Run a broker under uvicorn: recovery in the background, graceful shutdown on SIGTERM.

The broker holds its data directory's lock (``qmq_broker.storage.lock``) from before
recovery until it exits, so a second broker on the same directory is refused.

On SIGTERM or SIGINT the broker stops taking new requests (503), wakes long polls so they
answer at once, lets in-flight requests finish, writes a checkpoint and exits 0. A recovery
that fails stops the server too: the process exits 1 with one line on stderr, instead of
listening while it cannot serve. uvicorn speaks HTTP through ``qmq_broker.http.connections``,
which bounds connections: a cap, a header-read timeout and an idle timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from qmq_broker.config import BrokerConfig
from qmq_broker.engine import Broker
from qmq_broker.errors import ConfigError
from qmq_broker.http.app import create_app
from qmq_broker.http.auth import Authorizer
from qmq_broker.http.connections import (
    ConnectionLimits,
    ConnectionTracker,
    fit_to_open_files,
    protocol_class,
)
from qmq_broker.http.guard import GuardPolicy
from qmq_broker.http.hot import HotRoutes
from qmq_broker.memory import AfterBurst, malloc_trim
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.storage.lock import DataDirLock

logger = logging.getLogger(__name__)


def build(
    config: BrokerConfig,
    *,
    authorizer: Authorizer | None = None,
    guard: GuardPolicy | None = None,
    on_start_failure: Callable[[BaseException], None] | None = None,
) -> tuple[Broker, HotRoutes]:
    """The broker and its app; ``on_start_failure`` hears of a recovery that failed."""
    metrics = BrokerMetrics()
    broker = Broker(config, metrics=metrics)

    def started(task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        failure = task.exception()
        assert failure is not None
        logger.critical(
            "broker failed to start", extra={"action": "broker.start_failed"}, exc_info=failure
        )
        if on_start_failure is not None:
            on_start_failure(failure)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        starting = asyncio.create_task(broker.start(), name="qmq-recovery")
        starting.add_done_callback(started)
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await starting
            elif starting.exception() is None:
                await broker.close()

    return broker, create_app(broker, authorizer=authorizer, guard=guard, lifespan=lifespan)


class _Server(uvicorn.Server):
    """uvicorn server that tells the broker to stop taking work as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, broker: Broker) -> None:
        super().__init__(config)
        self._broker = broker

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after shutting down, so the process would
        # die of SIGTERM; a graceful stop is a normal exit (status 0).
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: Any) -> None:
        logger.info("shutting down", extra={"action": "broker.shutdown", "signal": sig})
        self._broker.begin_shutdown()
        super().handle_exit(sig, frame)


def serve(
    config: BrokerConfig,
    *,
    host: str,
    port: int,
    authorizer: Authorizer | None = None,
    guard: GuardPolicy | None = None,
) -> None:
    """Serve ``config.data_dir`` on ``host:port`` until a signal, holding the directory's lock
    from before recovery to exit; ``DataDirLocked`` when another process holds it."""
    with DataDirLock(config.data_dir):
        _serve(config, host=host, port=port, authorizer=authorizer, guard=guard)


def _serve(
    config: BrokerConfig,
    *,
    host: str,
    port: int,
    authorizer: Authorizer | None,
    guard: GuardPolicy | None,
) -> None:
    failures: list[BaseException] = []

    def stop_serving(failure: BaseException) -> None:
        # Never listen while failed: a supervisor must see the process die.
        failures.append(failure)
        server.should_exit = True

    broker, app = build(
        config,
        authorizer=authorizer,
        guard=guard or GuardPolicy.for_bind(host, allow_origins=()),
        on_start_failure=stop_serving,
    )
    server_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=protocol_class(_connections(config, broker.metrics)),
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=int(config.shutdown_timeout_s),
        limit_concurrency=None,
        backlog=2048,
    )
    server = _Server(server_config, broker)
    logger.info(
        "broker starting",
        extra={
            "action": "broker.starting",
            "data_dir": str(config.data_dir),
            "host": host,
            "port": port,
            "fsync": str(config.fsync),
        },
    )
    server.run()
    if failures:
        print(
            f"qmq broker: recovery of {config.data_dir} failed: {failures[0]}. "
            "It exits rather than listen while it cannot serve; see docs/broker.md, Recovery.",
            file=sys.stderr,
        )
        raise SystemExit(1)
    if broker.status == "failed":
        raise SystemExit(1)


def _connections(config: BrokerConfig, metrics: BrokerMetrics) -> ConnectionTracker:
    """The connection limits of ``config``; a bad one stops the broker (exit 2)."""
    try:
        limits = ConnectionLimits(
            header_timeout_s=config.header_timeout_s,
            idle_timeout_s=config.idle_timeout_s,
            max_connections=fit_to_open_files(config.max_connections),
            cancel_on_disconnect=frozenset({"/v1/pull"}),  # a long poll nobody awaits
        )
    except ConfigError as exc:
        print(f"qmq broker: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    trim = malloc_trim()  # a burst of connections ended: give its memory back
    on_count = AfterBurst(trim).level if trim is not None else None
    return ConnectionTracker(limits, metrics=metrics, on_count=on_count)
