"""``qmq compensator``: resend unconfirmed outbox rows until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta
from types import FrameType

import click
import sqlalchemy as sa

from qmq_outbox.cli.params import DURATION
from qmq_outbox.compensator import Compensator
from qmq_outbox.dburl import sync_database_url

logger = logging.getLogger(__name__)


@click.command()
@click.option(
    "--database-url",
    required=True,
    show_envvar=True,
    help="SQLAlchemy URL of the outbox's database.",
)
@click.option(
    "--broker-url",
    required=True,
    show_envvar=True,
    help="Broker base URL, e.g. http://127.0.0.1:8931.",
)
@click.option("--broker-token", default=None, show_envvar=True, help="Bearer token for the broker.")
@click.option(
    "--interval",
    type=DURATION,
    default="1s",
    show_default=True,
    show_envvar=True,
    help="Pause between passes.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 1000),
    default=500,
    show_default=True,
    show_envvar=True,
    help="Rows claimed and sent per batch.",
)
@click.option(
    "--grace",
    type=DURATION,
    default="30s",
    show_default=True,
    show_envvar=True,
    help="Leave rows this young to the dispatcher.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    show_envvar=True,
    help="Attempts before a row is marked dead.",
)
@click.option(
    "--retention",
    type=DURATION,
    default="7d",
    show_default=True,
    show_envvar=True,
    help="Keep sent rows this long (for reconciliation).",
)
@click.option(
    "--lease",
    type=DURATION,
    default="60s",
    show_default=True,
    show_envvar=True,
    help="How long a claim holds a row.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    show_envvar=True,
    help="Serve Prometheus metrics on this port.",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    show_envvar=True,
    help="Address for the metrics endpoint.",
)
@click.option("--once", is_flag=True, show_envvar=True, help="Run one pass and exit.")
@click.option(
    "--stop-timeout",
    type=DURATION,
    default="30s",
    show_default=True,
    show_envvar=True,
    help="Wait this long for the current batch on shutdown.",
)
def compensator(
    database_url: str,
    broker_url: str,
    broker_token: str | None,
    interval: timedelta,
    batch_size: int,
    grace: timedelta,
    max_attempts: int,
    retention: timedelta,
    lease: timedelta,
    metrics_port: int | None,
    metrics_host: str,
    once: bool,
    stop_timeout: timedelta,
) -> None:
    """Claim pending outbox rows older than --grace, resend them, mark them sent or dead.

    Several compensators may run against one PostgreSQL database; on SQLite run one.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = sa.create_engine(sync_database_url(database_url), pool_pre_ping=True)
    worker = Compensator(
        engine=engine,
        broker_url=broker_url,
        token=broker_token,
        interval=interval,
        batch_size=batch_size,
        grace=grace,
        max_attempts=max_attempts,
        retention=retention,
        lease=lease,
    )
    server = None
    try:
        if once:
            result = worker.run_once()
            click.echo(
                f"claimed={result.claimed} sent={result.sent} duplicates={result.duplicates} "
                f"retried={result.retried} dead={result.dead} purged={result.purged}"
            )
            return
        if metrics_port is not None:
            from prometheus_client import start_http_server

            server, _ = start_http_server(metrics_port, addr=metrics_host, registry=worker.registry)
        _run_until_signalled(worker, stop_timeout)
    finally:
        if server is not None:
            server.shutdown()
        worker.stop(stop_timeout.total_seconds())
        engine.dispose()


def _run_until_signalled(worker: Compensator, stop_timeout: timedelta) -> None:
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
