"""Run a broker under uvicorn: recovery in the background, graceful shutdown on SIGTERM.

On SIGTERM or SIGINT the broker stops taking new requests (503), wakes long polls so they
answer at once, lets in-flight requests finish, writes a checkpoint and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from broker.config import BrokerConfig
from broker.engine import Broker
from broker.http.app import create_app
from broker.http.auth import Authorizer
from broker.metrics import BrokerMetrics

logger = logging.getLogger(__name__)


def build(
    config: BrokerConfig, *, authorizer: Authorizer | None = None
) -> tuple[Broker, Starlette]:
    metrics = BrokerMetrics()
    broker = Broker(config, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        starting = asyncio.create_task(broker.start(), name="qmq-recovery")
        starting.add_done_callback(_report_start_failure)
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await starting
            elif starting.exception() is None:
                await broker.close()

    return broker, create_app(broker, authorizer=authorizer, lifespan=lifespan)


def _report_start_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.critical(
            "broker failed to start",
            extra={"action": "broker.start_failed"},
            exc_info=task.exception(),
        )


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
    config: BrokerConfig, *, host: str, port: int, authorizer: Authorizer | None = None
) -> None:
    broker, app = build(config, authorizer=authorizer)
    server_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
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
    if broker.status == "failed":
        raise SystemExit(1)
