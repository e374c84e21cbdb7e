"""The consumer-side check (``--consumed``) on RabbitMQ, whose queues cannot be read back:
which of the outbox's messages the group never handled, and what it handled that no outbox
row stands for.

The world: one PostgreSQL database holding the service's outbox and the consumer's
``qmq_consumed`` table. ``SENT`` messages go through ``Outbox(transport=RabbitMqTransport)``
to a fresh exchange, and a real ``Consumer`` with ``IdempotentStore`` handles them all.
Planted: a row marked ``sent`` an hour ago that never reached the group (``never``), one
to a subject the group does not take (``elsewhere``: not the group's to consume), and a
``qmq_consumed`` row of the group with no outbox row (``ghost``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from pyspark.sql import SparkSession
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message, Outbox
from qmq_outbox.schema import consumed_table, metadata, outbox_table
from qmq_outbox.transports import RabbitMqTransport
from qmq_outbox.transports.base import ConsumerSpec
from qmq_reconcile import reconcile
from tests.integration.consumer_support import count, running, wait_for
from tests.spark.worlds import row
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.spark

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
PRODUCER, GROUP = "ledger-svc", "billing"
SENT = 10


@dataclass(frozen=True)
class World:
    url: str
    subject: str


async def _declare(transport: RabbitMqTransport, subject: str) -> None:
    """The group's queue, bound before anything is published (RabbitMQ routes a message
    only to queues that exist)."""
    spec = ConsumerSpec(
        group=GROUP,
        consumer_id="declare",
        subjects=(subject,),
        start="earliest",
        capacity=1,
        connections=1,
    )
    client = await transport.open_consumer(spec)
    try:
        assert await client.pull(subject, GROUP, "declare", max_messages=1, wait_ms=0) == []
    finally:
        await client.aclose()


async def _remove(exchange: str, subject: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        for queue in (f"{GROUP}.{subject}", f"{GROUP}.{subject}.retry", f"{GROUP}.{subject}.dead"):
            await channel.queue_delete(queue)
        await channel.exchange_delete(exchange)
    finally:
        await connection.close()


@pytest.fixture(scope="module")
def world(pg_admin_url: str) -> Iterator[World]:
    tag = uuid.uuid4().hex[:8]
    exchange, subject = f"qrc-{tag}", f"ledger.{tag}"
    transport = RabbitMqTransport(url=AMQP_URL, exchange=exchange)
    with fresh_database(pg_admin_url, prefix="qmq_reconcile_consumed") as url:
        engine = sa.create_engine(url)
        metadata.create_all(engine)
        maker = sessionmaker(engine)
        asyncio.run(_declare(transport, subject))
        try:
            outbox = Outbox(transport=transport, app=PRODUCER)
            outbox.install(maker)
            for n in range(SENT):
                with maker.begin() as session:
                    outbox.publish(session, subject, {"n": n})
            assert outbox.close(drain_timeout=20)

            consumer = Consumer(transport=transport, group=GROUP, wait_ms=200)

            def bill(message: Message, session: Session) -> None:
                assert message.json()["n"] >= 0

            consumer.add_handler(subject, bill, idempotent=IdempotentStore(maker))
            with running(consumer):
                wait_for(lambda: count(engine, consumed_table) == SENT, what="all consumed")

            old = datetime.now(UTC) - timedelta(hours=1)
            with engine.begin() as conn:
                conn.execute(
                    outbox_table.insert(),
                    [
                        row("never", "sent", producer=PRODUCER, subject=subject, created=old),
                        row("elsewhere", "sent", producer=PRODUCER, subject="audit", created=old),
                    ],
                )
                conn.execute(
                    consumed_table.insert().values(
                        consumer_group=GROUP,
                        message_id="ghost",
                        status="done",
                        consumed_at=datetime.now(UTC) - timedelta(seconds=1),
                    )
                )
            yield World(url=url, subject=subject)
        finally:
            engine.dispose()
            asyncio.run(_remove(exchange, subject))


def test_never_consumed_and_consumed_without_outbox(
    world: World, tmp_path: Path, spark: SparkSession
) -> None:
    out = tmp_path / "out"
    summary = reconcile(
        outboxes=[world.url],
        broker_dirs=[],
        consumed=world.url,
        group=GROUP,
        subjects=[world.subject],
        out=out,
        grace=timedelta(0),
        ack_threshold=timedelta(0),
        spark=spark,
    )
    assert summary["categories_judged"] is False  # no broker data to judge them by
    checked = summary["consumed"]
    assert (checked["group"], checked["subjects"]) == (GROUP, [world.subject])
    never = checked["never_consumed"]
    assert never["count"] == 1
    assert [(m["message_id"], m["subject"]) for m in never["messages"]] == [
        ("never", world.subject)
    ]
    extra = checked["consumed_without_outbox"]
    assert [m["message_id"] for m in extra["messages"]] == ["ghost"]
    assert extra["count"] == 1
    assert summary["exit_code"] == 1  # a committed message the group never got is critical
    written = spark.read.parquet(str(out / "never_consumed")).collect()
    assert [r["message_id"] for r in written] == ["never"]
    assert (out / "consumed_without_outbox").is_dir()
    text = (out / "report.txt").read_text()
    assert "not judged (no broker data)" in text
    assert f"consumed by group {GROUP}" in text
    assert "1 message(s) never consumed -> exit 1" in text
    assert "<h2>Consumed by group billing</h2>" in (out / "report.html").read_text()


def test_a_group_that_consumed_everything_is_clean(
    world: World, tmp_path: Path, spark: SparkSession
) -> None:
    """Judged only by what was sent before the threshold: the planted row is an hour old,
    the rest are fresh and consumed; with a threshold of two hours nothing is late yet."""
    summary = reconcile(
        outboxes=[world.url],
        broker_dirs=[],
        consumed=world.url,
        group=GROUP,
        subjects=[world.subject],
        out=tmp_path / "out",
        grace=timedelta(0),
        ack_threshold=timedelta(hours=2),
        spark=spark,
    )
    assert summary["consumed"]["never_consumed"]["count"] == 0
    assert summary["exit_code"] == 0
