"""``qmq compensator`` as a process: one pass, and a service with metrics stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from qmq_outbox import migrate
from qmq_outbox.client import BrokerClient
from qmq_outbox.store import OutboxStore
from tests.support.broker_process import BrokerProcess, free_port
from tests.support.outbox import pending_rows, statuses, stored_count, unique_subject, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def db_url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(tmp_path_factory.mktemp("cli-broker") / "data").start()
    yield proc
    proc.stop()


def qmq(*args: str) -> list[str]:
    return [sys.executable, "-m", "qmq_outbox", *args]


def test_compensator_once(db_url: str, broker: BrokerProcess) -> None:
    subject = unique_subject("cli")
    engine = sa.create_engine(db_url)
    OutboxStore(engine).insert(pending_rows(5, subject=subject))
    env = {**os.environ, "QMQ_COMPENSATOR_BROKER_URL": broker.url}
    proc = subprocess.run(
        qmq("compensator", "--database-url", db_url, "--once", "--grace", "0s"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "sent=5" in proc.stdout
    with BrokerClient(broker.url) as client:
        assert stored_count(client, subject) == 5
    engine.dispose()


def test_compensator_service_metrics_and_sigterm(db_url: str, broker: BrokerProcess) -> None:
    subject = unique_subject("svc")
    port = free_port()
    env = {
        **os.environ,
        "QMQ_COMPENSATOR_DATABASE_URL": db_url,
        "QMQ_COMPENSATOR_BROKER_URL": broker.url,
        "QMQ_COMPENSATOR_INTERVAL": "100ms",
        "QMQ_COMPENSATOR_GRACE": "0",
        "QMQ_COMPENSATOR_METRICS_PORT": str(port),
    }
    proc = subprocess.Popen(
        qmq("compensator"), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    engine = sa.create_engine(db_url)
    try:
        OutboxStore(engine).insert(pending_rows(8, subject=subject))
        wait_for(lambda: set(statuses(engine, subject=subject).values()) == {"sent"}, timeout=30)

        def scraped() -> str | None:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                return None
            return text if "qmq_compensator_sent_messages_total 8.0" in text else None

        text = wait_for(scraped, timeout=15, what="metrics")
        assert "qmq_compensator_pending_messages 0.0" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        engine.dispose()
    output = proc.stdout.read().decode() if proc.stdout else ""
    assert "compensator stopped" in output
