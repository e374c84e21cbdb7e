"""Helpers for the outbox tests: polling with a deadline, reading what the broker stored."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qmq_outbox.client import BrokerClient
from qmq_outbox.errors import BrokerRejected
from qmq_outbox.schema import outbox_table

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def unique_subject(prefix: str = "t") -> str:
    return f"{prefix}.{uuid.uuid4().hex[:12]}"


def stored_ids(client: BrokerClient, subject: str) -> Counter[str]:
    """Every message id stored on ``subject``, with multiplicity (read on a fresh group)."""
    group = f"check-{uuid.uuid4().hex[:8]}"
    ids: Counter[str] = Counter()
    while True:
        try:
            batch = client.pull(subject, group, "checker", max_messages=1000, wait_ms=0)
        except BrokerRejected as exc:
            if exc.status == 404:
                return ids
            raise
        if not batch:
            return ids
        ids.update(m.id for m in batch)


def stored_count(client: BrokerClient, subject: str) -> int:
    try:
        return int(client.subject(subject)["messages"])
    except BrokerRejected as exc:
        if exc.status == 404:
            return 0
        raise


def statuses(engine: Engine, *, subject: str | None = None) -> dict[str, str]:
    """message_id → status of the outbox rows (of one subject)."""
    t = outbox_table
    stmt = sa.select(t.c.message_id, t.c.status)
    if subject is not None:
        stmt = stmt.where(t.c.subject == subject)
    with engine.connect() as conn:
        return {row.message_id: row.status for row in conn.execute(stmt)}


def clear_outbox(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.delete(outbox_table))


def sqlite_transactions(engine: Engine) -> Engine:
    """Make pysqlite honour BEGIN/SAVEPOINT (SQLAlchemy's documented recipe), with WAL and
    BEGIN IMMEDIATE so concurrent writers queue on the busy timeout instead of failing."""

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: object, _record: object) -> None:
        dbapi_connection.isolation_level = None  # type: ignore[attr-defined]
        cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=10000")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def pending_rows(
    count: int,
    *,
    subject: str,
    age: float = 300.0,
    body: bytes = b"{}",
    prefix: str | None = None,
) -> list[dict[str, object]]:
    """Rows as ``publish()`` would have left them ``age`` seconds ago, never dispatched."""
    from datetime import UTC, datetime, timedelta

    created = datetime.now(UTC) - timedelta(seconds=age)
    tag = prefix or uuid.uuid4().hex[:8]
    return [
        {
            "message_id": f"{tag}-{i}",
            "subject": subject,
            "key": None,
            "headers": {},
            "body": body,
            "content_type": "application/json",
            "producer": "test",
            "deliver_at": None,
            "status": "pending",
            "attempts": 0,
            "next_attempt_at": created,
            "created_at": created,
            "sent_at": None,
            "last_error": None,
            "claim_token": None,
            "claimed_until": None,
        }
        for i in range(count)
    ]


async def wait_for_async(
    predicate: Callable[[], T], *, within: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """``wait_for`` that yields to the event loop between polls."""
    import asyncio

    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what or predicate}")
        await asyncio.sleep(interval)
