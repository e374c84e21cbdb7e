"""Fixtures shared by every tier: a fresh PostgreSQL database per session, broker processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.broker_process import BrokerProcess
from tests.support.postgres import fresh_database, server_url


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    with server_url() as url:
        if url is None:
            message = (
                "no PostgreSQL: set QMQ_TEST_DATABASE_URL, run one on 127.0.0.1:5432, "
                "or provide a Docker engine for testcontainers"
            )
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
        yield url


@pytest.fixture(scope="session")
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A database created for this test session and dropped after it."""
    with fresh_database(pg_admin_url) as url:
        yield url


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[type[BrokerProcess]]:
    """``broker_factory(data_dir, extra_args=[...]).start()``; all are killed at the end."""
    started: list[BrokerProcess] = []

    class _Tracked(BrokerProcess):
        def start(self, *, wait: bool = True, timeout: float = 30.0) -> BrokerProcess:
            if self not in started:
                started.append(self)
            return super().start(wait=wait, timeout=timeout)

    yield _Tracked
    for proc in started:
        proc.stop()


@pytest.fixture
def broker(broker_factory: type[BrokerProcess], tmp_path: Path) -> BrokerProcess:
    """One running broker on a fresh data dir."""
    return broker_factory(tmp_path / "broker-data").start()
