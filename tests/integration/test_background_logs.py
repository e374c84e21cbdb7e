"""What background loops write while a dependency is down: the compensator daemon against a
real PostgreSQL database that stops accepting connections for 10 s, and a consumer against
a real broker process that is down when it starts and comes up later."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from qmq_outbox import BrokerClient, Consumer, Message
from qmq_outbox.compensator import Compensator
from qmq_outbox.schema import metadata
from qmq_outbox.store import OutboxStore
from qmq_outbox.testing import InMemoryBroker
from tests.integration.consumer_support import produce, running
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import pending_rows, statuses, wait_for
from tests.support.postgres import fresh_database

OUTAGE = 10.0  # seconds the database refuses connections
PASSWORD = "s3cret-not-for-logs"  # trust auth ignores it; the log lines must not show it


@pytest.fixture
def database(pg_admin_url: str) -> Iterator[str]:
    """A fresh database with the outbox table; yields its URL, with a password."""
    with fresh_database(pg_admin_url, prefix="qmq_outage") as url:
        engine = sa.create_engine(url)
        metadata.create_all(engine)
        engine.dispose()
        yield make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def set_accepting(admin_url: str, database: str, accepting: bool) -> None:
    """Let the database take connections or not; refusing also ends the open ones."""
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(
                sa.text(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS {str(accepting).lower()}')
            )
            if not accepting:
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": database},
                )
    finally:
        admin.dispose()


def actions(records: list[logging.LogRecord], prefix: str) -> list[str]:
    return [
        r.__dict__["action"] for r in records if r.__dict__.get("action", "").startswith(prefix)
    ]


def first(records: list[logging.LogRecord], action: str) -> logging.LogRecord:
    return next(r for r in records if r.__dict__.get("action") == action)


def test_the_compensator_daemon_writes_a_handful_of_lines_for_a_10_s_database_outage(
    pg_admin_url: str, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    name = make_url(database).database
    assert name is not None
    engine = sa.create_engine(database, pool_pre_ping=True)  # as `qmq compensator` makes it
    fake = InMemoryBroker()
    comp = Compensator(
        engine=engine,
        client=fake.client(),
        interval=timedelta(milliseconds=50),
        grace=timedelta(0),
        backoff_cap=timedelta(seconds=1),
        outage_summary=timedelta(seconds=4),
    )
    comp.start()
    try:
        set_accepting(pg_admin_url, name, False)
        down_at = time.monotonic()
        wait_for(lambda: actions(caplog.records, "outbox.compensator.database"), what="failing")
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))  # the outage itself
        set_accepting(pg_admin_url, name, True)
        wait_for(
            lambda: "outbox.compensator.database.recovered" in actions(caplog.records, "outbox"),
            timeout=10,
            what="recovered",
        )
        OutboxStore(engine).insert(pending_rows(1, subject="after.outage", prefix="late"))
        wait_for(lambda: set(statuses(engine).values()) == {"sent"}, what="the loop lives on")
    finally:
        assert comp.stop(10)
        engine.dispose()

    records = list(caplog.records)
    outage = actions(records, "outbox.compensator.database")
    assert outage[0] == "outbox.compensator.database.failing"
    assert outage[-1] == "outbox.compensator.database.recovered"
    assert set(outage[1:-1]) == {"outbox.compensator.database.still_failing"}
    assert 1 <= len(outage[1:-1]) <= 3  # every 4 s of a 10 s outage
    # What an operator sees: ours at any level, anyone's warnings. (APScheduler's per-job
    # INFO lines are the application's to silence, as `qmq compensator` does.)
    shown = [r for r in records if r.name.startswith("qmq_outbox") or r.levelno >= 30]
    assert len(shown) <= 8, [r.getMessage() for r in shown]
    assert all(r.exc_info is None for r in records)  # no tracebacks, from anyone
    assert all(PASSWORD not in r.getMessage() for r in records)

    failing = first(records, "outbox.compensator.database.failing").getMessage()
    assert f"compensator: database postgresql+psycopg://postgres:***@127.0.0.1:5432/{name}" in (
        failing
    )
    assert "not currently accepting connections" in failing or "terminat" in failing
    recovered = first(records, "outbox.compensator.database.recovered")
    assert "recovered after 1" in recovered.getMessage()  # 10-12 s
    # Passes backed off (1 s at most) instead of coming every 50 ms: ~200 failures.
    assert 5 <= recovered.__dict__["failures"] <= 40


def test_a_consumer_logs_a_broker_outage_once_and_its_recovery_once(
    broker_factory: type[BrokerProcess], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="qmq_outbox")
    broker = broker_factory(tmp_path / "broker")  # not started yet: its port refuses
    subject = f"orders.{uuid.uuid4().hex[:8]}"
    consumer = Consumer(broker.url, "billing", wait_ms=200, ack_interval=0.02, shutdown_timeout=5)
    handled = threading.Event()

    @consumer.handler(subject)
    def handle(message: Message) -> None:
        handled.set()

    with running(consumer):
        wait_for(lambda: actions(caplog.records, "consumer.broker"), what="failing")
        broker.start()  # takes about a second: more failed pulls, which must not be logged
        with BrokerClient(broker.url) as client:
            produce(client, subject, [b"{}"])
        assert handled.wait(15)
    records = list(caplog.records)

    assert actions(records, "consumer.broker") == [
        "consumer.broker.failing",
        "consumer.broker.recovered",
    ]
    failing = first(records, "consumer.broker.failing")
    assert failing.getMessage().startswith(
        f"consumer billing: broker {broker.url} failing (pull {subject}): broker unreachable: "
    )
    assert failing.exc_info is None
    recovered = first(records, "consumer.broker.recovered")
    assert recovered.getMessage().startswith(
        f"consumer billing: broker {broker.url} recovered after "
    )
    assert recovered.__dict__["failures"] >= 2
    assert [r for r in records if r.levelno >= logging.WARNING] == [failing, recovered]
