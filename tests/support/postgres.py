"""Find a PostgreSQL server for the tests and create a fresh database on it.

Order: ``QMQ_TEST_DATABASE_URL``; else the local default URL; else testcontainers when a
Docker engine answers. With ``CI=true`` a missing server fails the run instead of skipping.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import make_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _reachable(url: str) -> bool:
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return True
    except sa.exc.OperationalError:
        return False
    finally:
        engine.dispose()


@contextmanager
def server_url() -> Iterator[str | None]:
    """Yield an admin URL of a reachable server, or None when there is none."""
    explicit = os.environ.get("QMQ_TEST_DATABASE_URL")
    if explicit:
        yield explicit if _reachable(explicit) else None
        return
    if _reachable(DEFAULT_URL):
        yield DEFAULT_URL
        return
    try:
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15", driver="psycopg") as container:
            yield container.get_connection_url()
    except Exception:  # no Docker engine, or the image could not be had
        yield None


@contextmanager
def fresh_database(admin_url: str, prefix: str = "qmq_test") -> Iterator[str]:
    """Create a uniquely named database, yield its URL, drop it afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
