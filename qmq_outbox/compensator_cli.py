"""``qmq compensator``: resend unconfirmed outbox rows until SIGTERM/SIGINT.

Its options come from ``CompensatorConfig`` and ``CompensatorService``; each is also read from
``QMQ_COMPENSATOR_<OPTION>`` (shown in ``--help``).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from datetime import timedelta
from types import FrameType
from typing import Any

import click
import sqlalchemy as sa

from qmq_outbox.cli.options import option_field, options_from, take
from qmq_outbox.compensator import Compensator, PassResult
from qmq_outbox.compensator_config import CompensatorConfig
from qmq_outbox.dburl import sync_database_url

logger = logging.getLogger(__name__)

ENVVAR_PREFIX = "QMQ_COMPENSATOR"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompensatorService:
    """What the compensator process needs besides the ``CompensatorConfig``."""

    database_url: str = dataclasses.field(
        metadata={"help": "SQLAlchemy URL of the outbox's database.", "unit": "text"}
    )
    broker_url: str = dataclasses.field(
        metadata={"help": "Broker base URL, e.g. http://127.0.0.1:8931.", "unit": "text"}
    )
    broker_token: str | None = option_field(None, "Bearer token for the broker.", "text")
    metrics_port: int | None = option_field(
        None, "Serve Prometheus metrics on this port.", "count", min=0, max=65535
    )
    metrics_host: str = option_field("127.0.0.1", "Address for the metrics endpoint.", "text")
    once: bool = option_field(False, "Run one pass and exit.", "flag")
    stop_timeout: timedelta = option_field(
        timedelta(seconds=30), "Wait this long for the current batch on shutdown.", "duration"
    )


@click.command()
@options_from(CompensatorService, envvar_prefix=ENVVAR_PREFIX)
@options_from(CompensatorConfig, envvar_prefix=ENVVAR_PREFIX)
def compensator(**values: Any) -> None:
    """Claim pending outbox rows older than --grace, resend them, mark them sent or dead.

    Several compensators may run against one PostgreSQL database; on SQLite run one.
    """
    service = take(CompensatorService, values)
    config = take(CompensatorConfig, values)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = sa.create_engine(sync_database_url(service.database_url), pool_pre_ping=True)
    worker = Compensator(
        engine=engine, broker_url=service.broker_url, token=service.broker_token, config=config
    )
    server = None
    try:
        if service.once:
            click.echo(_counts(worker.run_once()))
            return
        if service.metrics_port is not None:
            from prometheus_client import start_http_server

            server, _ = start_http_server(
                service.metrics_port, addr=service.metrics_host, registry=worker.registry
            )
        _run_until_signalled(worker)
    finally:
        if server is not None:
            server.shutdown()
        worker.stop(service.stop_timeout.total_seconds())
        engine.dispose()


def _counts(result: PassResult) -> str:
    shown = ("claimed", "sent", "duplicates", "retried", "dead", "purged")
    return " ".join(f"{name}={getattr(result, name)}" for name in shown)


def _run_until_signalled(worker: Compensator) -> None:
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %d: stopping", signum, extra={"action": "outbox.compensator_signal"})
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker.start()
        stopping.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
