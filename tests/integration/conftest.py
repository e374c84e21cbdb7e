"""Fixtures of the integration tier: a migrated outbox database, its engine, and one broker
process per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from qmq_outbox import migrate
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import clear_outbox, sqlite_transactions
from tests.support.postgres import fresh_database


def _module_name(request: pytest.FixtureRequest) -> str:
    return str(request.module.__name__).rpartition(".")[2].removeprefix("test_")


@pytest.fixture(scope="module")
def pg_url_migrated(pg_admin_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A PostgreSQL database for the test module, migrated to head, dropped after it."""
    with fresh_database(pg_admin_url, prefix=f"qmq_{_module_name(request)}") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated outbox database of each kind the outbox runs on (a module that wants
    PostgreSQL alone overrides this with ``pg_url_migrated``)."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url_migrated")
        return url
    url = f"sqlite:///{tmp_path / 'app.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on ``db_url`` with an empty outbox table."""
    engine = sa.create_engine(db_url, pool_size=12)
    if engine.dialect.name == "sqlite":
        sqlite_transactions(engine)
    clear_outbox(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def module_broker(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[BrokerProcess]:
    """One broker process for the test module (its tests use their own subjects)."""
    proc = BrokerProcess(tmp_path_factory.mktemp(f"{_module_name(request)}-broker") / "data")
    yield proc.start()
    proc.stop()
