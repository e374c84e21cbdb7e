"""``run_async()`` with AsyncSession on PostgreSQL, and the store on SQLite, against a real
broker process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import BrokerClient, Consumer, IdempotentStore, Message
from qmq_outbox.schema import metadata
from tests.integration.consumer_support import (
    business,
    consumer_database,
    count,
    group_state,
    invoices,
    produce,
    reset,
    running,
    unique,
    wait_for,
)
from tests.support.broker_process import BrokerProcess
from tests.support.waiting import wait_until_async


@pytest.fixture(scope="module")
def fast_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(
        tmp_path_factory.mktemp("consumer-async") / "broker",
        extra_args=["--ack-timeout", "1s", "--max-attempts", "3"],
    )
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def client(fast_broker: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(fast_broker.url) as client:
        yield client


@pytest.fixture(scope="module")
def db_url(pg_admin_url: str) -> Iterator[str]:
    with consumer_database(pg_admin_url) as url:
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = sa.create_engine(db_url)
    reset(engine)
    yield engine
    engine.dispose()


@pytest.fixture
async def async_sm(db_url: str, engine: Engine) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    async_engine = create_async_engine(make_url(db_url).set(drivername="postgresql+psycopg_async"))
    yield async_sessionmaker(async_engine)
    await async_engine.dispose()


def _consumer(url: str, group: str, **kwargs: object) -> Consumer:
    settings: dict[str, object] = {"wait_ms": 200, "ack_interval": 0.02, "shutdown_timeout": 10}
    settings.update(kwargs)
    return Consumer(url, group, **settings)  # type: ignore[arg-type]


async def _abill(message: Message, session: AsyncSession) -> None:
    await session.execute(
        sa.insert(invoices).values(
            order_id=message.json()["order_id"], message_id=message.id, amount=10
        )
    )


async def test_run_async_with_async_store_and_a_lease_expiring_mid_handler(
    fast_broker: BrokerProcess,
    client: BrokerClient,
    engine: Engine,
    async_sm: async_sessionmaker[AsyncSession],
) -> None:
    subject, group = unique("orders"), "billing"
    store = IdempotentStore(async_sm)
    await asyncio.to_thread(
        produce, client, subject, [f'{{"order_id": "o-{i}"}}'.encode() for i in range(30)]
    )
    attempts: list[tuple[int, int]] = []

    async def bill(message: Message, session: AsyncSession) -> None:
        attempts.append((message.seq, message.attempt))
        await _abill(message, session)
        if message.seq == 0 and message.attempt == 1:
            await asyncio.sleep(1.6)  # outlives the 1 s lease: seq 0 is redelivered meanwhile

    consumer = _consumer(fast_broker.url, group, concurrency=4)
    consumer.add_handler(subject, bill, idempotent=store)
    task = asyncio.create_task(consumer.run_async(install_signal_handlers=False))
    try:
        await wait_until_async(
            lambda: consumer.stats().processed >= 30 and consumer.stats().duplicates >= 1,
            within=15,
        )
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 15)
    # seq 0's redelivery at least; on a slow box a prefetched message's 1 s lease can run
    # out before a handler is free too: each redelivery is a duplicate, never a second bill
    assert consumer.stats().duplicates >= 1
    assert consumer.stats().processed == 30
    assert (0, 1) in attempts
    assert count(engine, invoices) == 30
    state = await asyncio.to_thread(group_state, client, subject, group)
    assert state["in_flight"] == 0
    assert state["acked"] == 30


def test_sync_consumer_with_the_store_on_sqlite(
    fast_broker: BrokerProcess, client: BrokerClient, tmp_path: Path
) -> None:
    subject, group = unique("orders"), "billing"
    sqlite = sa.create_engine(f"sqlite:///{tmp_path / 'consumer.db'}")
    metadata.create_all(sqlite)
    business.create_all(sqlite)
    store = IdempotentStore(sessionmaker(sqlite))
    produce(client, subject, [f'{{"order_id": "o-{i}"}}'.encode() for i in range(20)])
    (first,) = client.pull(subject, group, "crashed-before-ack", max_messages=1)

    def bill(message: Message, session: Session) -> None:
        session.execute(
            sa.insert(invoices).values(
                order_id=message.json()["order_id"], message_id=message.id, amount=10
            )
        )
        if message.seq == 5 and message.attempt == 1:
            raise RuntimeError("rolled back, retried by the broker after 1 s")

    store.process(group, first, bill)  # committed, never acked: redelivered after 1 s
    consumer = _consumer(fast_broker.url, group, concurrency=1)  # SQLite: one writer
    consumer.add_handler(subject, bill, idempotent=store)
    with running(consumer):
        wait_for(lambda: group_state(client, subject, group)["acked"] == 20)
    assert count(sqlite, invoices) == 20
    assert consumer.stats().duplicates == 1
    assert consumer.stats().nacked == 1
    sqlite.dispose()
