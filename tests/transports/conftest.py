"""Fixtures of the transport tests: the qmq broker, NATS JetStream and RabbitMQ as kits, a
database with the outbox, consumed and business tables.

NATS (127.0.0.1:4222) and RabbitMQ (127.0.0.1:5672) are the machine's services; a test
whose service does not answer is skipped, or fails under ``CI=true``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qmq_outbox import migrate
from qmq_outbox.errors import QmqError
from tests.integration.consumer_support import business
from tests.support.broker_process import BrokerProcess
from tests.support.postgres import fresh_database
from tests.transports.kits import JetStreamKit, Kit, QmqKit, RabbitMqKit

KINDS = ["qmq", "jetstream", "rabbitmq"]
TAG = uuid.uuid4().hex[:8]  # this session's names
ACK_TIMEOUT = "1s"  # the qmq broker's lease, as the other kits' (lease=1s)
MAX_ATTEMPTS = "3"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.transports)


def _reachable(kit: Kit) -> Kit:
    try:
        kit.transport().check()
    except QmqError as exc:
        kit.close()
        message = f"{kit.name} is not reachable at {kit.url()}: {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return kit


@pytest.fixture(scope="session")
def qmq_kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kit]:
    broker = BrokerProcess(
        tmp_path_factory.mktemp("transports-broker") / "data",
        extra_args=["--ack-timeout", ACK_TIMEOUT, "--max-attempts", MAX_ATTEMPTS],
    ).start()
    kit = QmqKit(TAG, broker.url)
    yield kit
    kit.close()
    broker.stop()


@pytest.fixture(scope="session")
def jetstream_kit() -> Iterator[Kit]:
    kit = _reachable(JetStreamKit(TAG))
    yield kit
    kit.close()


@pytest.fixture(scope="session")
def rabbitmq_kit() -> Iterator[Kit]:
    kit = _reachable(RabbitMqKit(TAG))
    yield kit
    kit.close()


@pytest.fixture(params=KINDS)
def kit(request: pytest.FixtureRequest) -> Kit:
    """Each transport in turn."""
    found: Kit = request.getfixturevalue(f"{request.param}_kit")
    return found


@pytest.fixture(scope="session")
def transports_db(pg_admin_url: str) -> Iterator[str]:
    """A database of this session with the SDK's tables and the business ones."""
    with fresh_database(pg_admin_url, prefix="qmq_transports") as url:
        migrate.upgrade(url)
        engine = sa.create_engine(url)
        business.create_all(engine)
        engine.dispose()
        yield url


@pytest.fixture
def engine(transports_db: str) -> Iterator[Engine]:
    engine = sa.create_engine(transports_db, pool_size=12)
    with engine.begin() as conn:
        for table in ("qmq_outbox", "qmq_consumed", "invoices", "effects"):
            conn.execute(sa.text(f"DELETE FROM {table}"))
    yield engine
    engine.dispose()
