"""Shared by the consumer's integration and acceptance tests: a database of their own with
``qmq_consumed`` and two business tables, producing, running consumers, polling."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qmq_outbox import BrokerClient, Consumer, OutgoingMessage
from qmq_outbox.schema import metadata
from tests.support.postgres import fresh_database

T = TypeVar("T")

business = sa.MetaData()
invoices = sa.Table(
    "invoices",
    business,
    sa.Column("order_id", sa.String(64), primary_key=True),
    sa.Column("message_id", sa.String(128), nullable=False),
    sa.Column("amount", sa.Integer, nullable=False),
)
# Outside effects (an e-mail sent, an API called): written outside the store's transactions,
# one row per time the effect happened.
effects = sa.Table(
    "effects",
    business,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("message_id", sa.String(128), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
)


@contextmanager
def consumer_database(admin_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database with the SDK's and the business tables; yields its URL."""
    with fresh_database(admin_url, prefix="qmq_consumer") as url:
        engine = sa.create_engine(url)
        metadata.create_all(engine)
        business.create_all(engine)
        engine.dispose()
        yield url


def reset(engine: Engine) -> None:
    with engine.begin() as conn:
        for table in ("qmq_consumed", "invoices", "effects"):
            conn.execute(sa.text(f"DELETE FROM {table}"))


def count(engine: Engine, table: sa.Table, **where: Any) -> int:
    query = sa.select(sa.func.count()).select_from(table)
    for column, value in where.items():
        query = query.where(table.c[column] == value)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def record_effect(engine: Engine, message_id: str, attempt: int) -> None:
    with engine.begin() as conn:
        conn.execute(sa.insert(effects).values(message_id=message_id, attempt=attempt))


def unique(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:10]}"


def produce(client: BrokerClient, subject: str, bodies: list[bytes]) -> list[str]:
    messages = [OutgoingMessage(id=unique("m"), subject=subject, body=body) for body in bodies]
    results = client.produce(messages)
    assert {r.status for r in results} == {"stored"}
    return [m.id for m in messages]


def wait_for(
    predicate: Callable[[], T], *, timeout: float = 15.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll until ``predicate()`` is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


@contextmanager
def running(*consumers: Consumer) -> Iterator[None]:
    """Each ``consumer.run()`` on its own thread; stopped and joined on exit."""
    errors: list[BaseException] = []

    def target(consumer: Consumer) -> None:
        try:
            consumer.run()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=target, args=(c,), name=f"test-run-{c.consumer_id}")
        for c in consumers
    ]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for consumer in consumers:
            consumer.stop()
        for thread in threads:
            thread.join(20)
            assert not thread.is_alive(), f"{thread.name} did not stop"
    if errors:
        raise errors[0]


def group_state(client: BrokerClient, subject: str, group: str) -> dict[str, Any]:
    """The broker's counters of a group (all zero before its first pull)."""
    for entry in client.subject(subject)["groups"]:
        if entry["group"] == group:
            return dict(entry)
    return dict.fromkeys(("backlog", "in_flight", "retrying", "dead", "acked"), 0)
