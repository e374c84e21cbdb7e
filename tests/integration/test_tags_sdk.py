"""Tags through the SDK with PostgreSQL and a real broker: ``publish(..., tags=[...])`` on
both send paths (in process and the compensator), and ``@handler(subject, tags=[...])``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from qmq_outbox import Consumer, Message, migrate
from qmq_outbox.client import BrokerClient
from qmq_outbox.compensator.config import CompensatorSettings
from qmq_outbox.errors import ConfigurationError, InvalidMessage
from qmq_outbox.outbox import Outbox
from qmq_outbox.store import OutboxStore
from tests.integration.consumer_support import running
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import clear_outbox, statuses, unique_subject, wait_for
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(120)
FAST: CompensatorSettings = {"grace": timedelta(seconds=1), "interval": timedelta(milliseconds=100)}


@pytest.fixture(scope="module")
def pg_url_migrated(pg_admin_url: str) -> Iterator[str]:
    with fresh_database(pg_admin_url, prefix="qmq_tags") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture
def engine(pg_url_migrated: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url_migrated)
    clear_outbox(engine)
    yield engine
    engine.dispose()


def publish_all(outbox: Outbox, engine: sa.Engine, subject: str, count: int) -> list[str]:
    """Message i tagged ``even`` or ``odd``, and ``vip`` every fifth one."""
    maker = sessionmaker(engine)
    outbox.install(maker)
    ids = []
    with maker.begin() as session:
        for i in range(count):
            tags = ["even" if i % 2 == 0 else "odd", *(["vip"] if i % 5 == 0 else [])]
            ids.append(outbox.publish(session, subject, {"i": i}, tags=tags))
    return ids


def stored_tags(url: str, subject: str) -> list[tuple[int, ...]]:
    with BrokerClient(url) as client:
        pulled = client.pull(subject, "check", "c", max_messages=100)
    return [(m.json()["i"], *sorted(m.tags)) for m in pulled]


def expected(count: int) -> list[tuple[int, ...]]:
    out = []
    for i in range(count):
        tags = ["even" if i % 2 == 0 else "odd", *(["vip"] if i % 5 == 0 else [])]
        out.append((i, *sorted(tags)))
    return out


def test_publish_sends_tags_in_process(engine: sa.Engine, broker: BrokerProcess) -> None:
    subject = unique_subject("tagged")
    outbox = Outbox(broker_url=broker.url, retry_for=0.5)
    try:
        publish_all(outbox, engine, subject, 10)
        wait_for(lambda: set(statuses(engine, subject=subject).values()) == {"sent"})
    finally:
        assert outbox.close(drain_timeout=10)
    assert stored_tags(broker.url, subject) == expected(10)


def test_the_compensator_sends_the_tags_kept_on_the_row(
    engine: sa.Engine, broker: BrokerProcess
) -> None:
    subject = unique_subject("kept")
    publish_all(Outbox(dispatch=False), engine, subject, 6)  # rows only, nothing sent
    far = datetime.now(UTC) + timedelta(hours=1)
    claimed = OutboxStore(engine).claim(
        token="t", now=far, grace=timedelta(0), lease=timedelta(seconds=1), limit=10
    )
    assert [row.message.tags for row in claimed] == [
        ("even", "vip"),
        ("odd",),
        ("even",),
        ("odd",),
        ("even",),
        ("odd", "vip"),
    ]
    with engine.begin() as conn:  # the claim's lease given back
        conn.execute(sa.text("UPDATE qmq_outbox SET claim_token = NULL, claimed_until = NULL"))
    outbox = Outbox(broker_url=broker.url, retry_for=0.5)
    outbox.run_compensator(engine, **FAST)
    try:
        wait_for(lambda: set(statuses(engine, subject=subject).values()) == {"sent"}, timeout=30)
    finally:
        assert outbox.close(drain_timeout=10)
    assert stored_tags(broker.url, subject) == expected(6)


def test_publish_refuses_bad_tags_before_the_insert(engine: sa.Engine) -> None:
    outbox = Outbox(dispatch=False)
    maker = sessionmaker(engine)
    outbox.install(maker)
    with maker() as session:
        for bad in (["a b"], ["x", "x"], [f"t{i}" for i in range(9)], "vip", ["x" * 65]):
            with pytest.raises(InvalidMessage):
                outbox.publish(session, "orders", {}, tags=bad)  # type: ignore[arg-type]
        session.rollback()


def test_a_handler_with_tags_gets_only_its_tags_and_the_broker_counts_the_rest(
    engine: sa.Engine, broker: BrokerProcess
) -> None:
    subject = unique_subject("handled")
    outbox = Outbox(broker_url=broker.url, retry_for=0.5)
    try:
        publish_all(outbox, engine, subject, 20)
        wait_for(lambda: set(statuses(engine, subject=subject).values()) == {"sent"})
    finally:
        assert outbox.close(drain_timeout=10)
    seen: list[int] = []
    lock = threading.Lock()
    consumer = Consumer(broker.url, "vips", wait_ms=200, ack_interval=0.02)

    @consumer.handler(subject, tags=["vip"])
    def handle(message: Message) -> None:
        with lock:
            seen.append(message.json()["i"])

    with running(consumer):
        wait_for(lambda: len(seen) == 4, what="the vip messages handled")
        with BrokerClient(broker.url) as client:
            wait_for(lambda: client.subject(subject)["groups"][0]["acked"] == 4, what="acks")
            (stats,) = client.subject(subject)["groups"]
    assert sorted(seen) == [0, 5, 10, 15]
    assert (stats["filtered"], stats["tags"], stats["in_flight"]) == (16, ["vip"], 0)
    assert consumer.stats().filtered == 0  # filtered on the broker: none came here


def test_a_handler_refuses_bad_tags_and_ordered_with_tags(broker: BrokerProcess) -> None:
    consumer = Consumer(broker.url, "g")
    with pytest.raises(ConfigurationError):
        consumer.add_handler("orders", lambda m: None, tags=["a b"])
    with pytest.raises(ConfigurationError):
        consumer.add_handler("ledger", lambda m: None, tags=["a"], ordered=True)
