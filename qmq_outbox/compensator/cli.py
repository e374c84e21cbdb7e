"""``qmq compensator``: resend unconfirmed outbox rows until SIGTERM/SIGINT, or once.

Its options come from ``CompensatorConfig`` and ``CompensatorService``; each is also read from
``QMQ_COMPENSATOR_<OPTION>`` (shown in ``--help``). The URLs are checked before any work
(exit 2). The daemon rides out an unreachable database or broker (its log says so);
``--once`` checks both first and exits 3 when one cannot be used, 1 when rows failed.
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

from qmq_cli.options import Unit, option_field, options_from, take
from qmq_outbox.cli import failures
from qmq_outbox.cli.urls import DATABASE_URL, CheckedUrl, check_broker_url, database_url_field
from qmq_outbox.compensator.config import CompensatorConfig
from qmq_outbox.compensator.worker import Compensator, PassResult
from qmq_outbox.dburl import mask_url, sync_database_url
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.schema import outbox_table
from qmq_outbox.store import NotDue, utcnow
from qmq_outbox.transports.urls import SCHEMES, from_url

logger = logging.getLogger(__name__)

ENVVAR_PREFIX = "QMQ_COMPENSATOR"


def check_transport_url(text: str) -> str:
    """A qmq broker URL as ``qmq broker`` takes it, or a NATS / RabbitMQ URL a transport can
    be made of (``ValueError``, the usage error's message, otherwise)."""
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if SCHEMES.get(scheme, "qmq") == "qmq":
        try:
            return check_broker_url(text)
        except ValueError as exc:
            others = "nats://host:port (NATS JetStream), amqp://user:pass@host:port/ (RabbitMQ)"
            raise ValueError(f"{exc}, or {others}") from None
    try:
        from_url(text)
    except ConfigurationError as exc:
        raise ValueError(str(exc)) from None
    return text


TRANSPORT_URL = CheckedUrl("url", check_transport_url)
UNITS = {"database_url": Unit(type=DATABASE_URL), "broker_url": Unit(type=TRANSPORT_URL)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompensatorService:
    """What the compensator process needs besides the ``CompensatorConfig``."""

    database_url: str = database_url_field()
    broker_url: str = dataclasses.field(
        metadata={
            "help": "Where to send: the qmq broker (http://127.0.0.1:8931), NATS JetStream "
            "(nats://127.0.0.1:4222) or RabbitMQ (amqp://guest:guest@127.0.0.1:5672/).",
            "unit": "broker_url",
        }
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
@options_from(CompensatorService, envvar_prefix=ENVVAR_PREFIX, units=UNITS)
@options_from(CompensatorConfig, envvar_prefix=ENVVAR_PREFIX)
@failures.reported
def compensator(**values: Any) -> None:
    """Claim pending outbox rows older than --grace, resend them, mark them sent or dead.

    Several compensators may run against one PostgreSQL database; on SQLite run one.
    With --once: print the pass's counts, then the pending rows it left (in_grace: younger
    than --grace; retrying: waiting for a retry) and when the next falls due; exit 1 when
    rows were rescheduled or marked dead, 3 when the database or the broker cannot be used.
    """
    service = take(CompensatorService, values)
    config = take(CompensatorConfig, values)
    _configure_logging(once=service.once, debug=failures.debugging())
    engine = sa.create_engine(sync_database_url(service.database_url), pool_pre_ping=True)
    try:
        if service.once:
            _run_once(engine, service, config)
        else:
            _serve(engine, service, config)
    finally:
        engine.dispose()


def _configure_logging(*, once: bool, debug: bool) -> None:
    """The daemon logs at INFO (DEBUG under ``qmq --debug``); ``--once`` prints its result
    and a failure's one line, and logs only under ``--debug``."""
    level = logging.DEBUG if debug else logging.INFO
    handlers = [logging.NullHandler()] if once and not debug else None
    line = "%(asctime)s %(levelname)s %(name)s %(message)s"
    logging.basicConfig(level=level, format=line, handlers=handlers)
    if not debug:  # APScheduler writes lines at INFO for every pass
        logging.getLogger("apscheduler").setLevel(logging.WARNING)


def _run_once(engine: sa.Engine, service: CompensatorService, config: CompensatorConfig) -> None:
    """One pass; the database and the broker are checked first, so that one that cannot be
    used fails the command (exit 3) before a row is claimed and its attempt spent."""
    with failures.using_database(service.database_url):
        _check_outbox_table(engine, service.database_url)
    worker = Compensator(
        engine=engine, broker_url=service.broker_url, token=service.broker_token, config=config
    )
    try:
        with failures.using_broker(service.broker_url):
            assert worker.transport is not None  # made from broker_url
            worker.transport.check()
        with failures.using_database(service.database_url):
            result = worker.run_once()
        with failures.using_database(service.database_url):
            not_due = worker.store.not_due(now=utcnow(), grace=config.grace)
    finally:
        worker.stop(service.stop_timeout.total_seconds())
    click.echo(_counts(result))
    click.echo(_not_due(not_due, config.grace))
    _judge(result, service.broker_url)


def _check_outbox_table(engine: sa.Engine, url: str) -> None:
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(outbox_table.name, schema=outbox_table.schema):
            raise failures.Unavailable(
                f"{mask_url(url)} has no {outbox_table.name} table: "
                "create it with qmq db upgrade --database-url URL"
            )


def _judge(result: PassResult, broker_url: str) -> None:
    """Raise the failure a pass with ``result`` is: the broker went away, or rows failed."""
    if result.unavailable:
        raise failures.Unavailable(
            f"broker at {broker_url} became unavailable (or refused the request) during the "
            "pass: "
            f"{result.retried} row(s) rescheduled, {result.dead} dead"
        )
    failed = result.retried + result.dead
    if failed:
        raise failures.Failed(
            f"{failed} of {result.claimed} claimed row(s) not sent (retried={result.retried} "
            f"dead={result.dead}); each row's last_error says why"
        )


def _serve(engine: sa.Engine, service: CompensatorService, config: CompensatorConfig) -> None:
    worker = Compensator(
        engine=engine, broker_url=service.broker_url, token=service.broker_token, config=config
    )
    server = None
    try:
        if service.metrics_port is not None:
            server = _metrics_server(worker, service.metrics_host, service.metrics_port)
        _run_until_signalled(worker)
    finally:
        if server is not None:
            server.shutdown()
        worker.stop(service.stop_timeout.total_seconds())


def _metrics_server(worker: Compensator, host: str, port: int) -> Any:
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr=host, registry=worker.registry)
    except OSError as exc:
        reason = failures.reason(exc)
        raise failures.Unavailable(f"cannot serve metrics on {host}:{port}: {reason}") from exc
    return server


def _not_due(rows: NotDue, grace: timedelta) -> str:
    """What the pass left for later: rows in their grace (the dispatcher's turn) and rows
    waiting for a retry, and when the first of them falls due."""
    line = f"in_grace={rows.in_grace} retrying={rows.retrying}"
    if rows.next_due_at is None:
        return line
    seconds = max(0.0, (rows.next_due_at - utcnow()).total_seconds())
    due = rows.next_due_at.isoformat(timespec="seconds").replace("+00:00", "Z")
    return f"{line} next_due={due} (in {seconds:.0f}s; --grace is {grace.total_seconds():g}s)"


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
