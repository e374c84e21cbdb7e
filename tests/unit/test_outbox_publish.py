"""``Outbox.publish`` and ``@transactional`` against SQLite and the in-memory fake broker."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox.errors import ConfigurationError, SerializationError
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import metadata, outbox_table
from qmq_outbox.serializers import OCTET_STREAM
from qmq_outbox.testing import InMemoryBroker
from qmq_outbox.uuid7 import uuid7
from qmq_outbox.validation import InvalidMessage
from tests.support.outbox import sqlite_transactions, statuses, wait_for


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sqlite_transactions(sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def maker(engine: sa.Engine) -> sessionmaker[Session]:
    return sessionmaker(engine)


@pytest.fixture
def fake() -> InMemoryBroker:
    return InMemoryBroker()


@pytest.fixture
def outbox(maker: sessionmaker[Session], fake: InMemoryBroker) -> Iterator[Outbox]:
    outbox = Outbox(client=fake.client(), app="orders")
    outbox.install(maker)
    yield outbox
    outbox.close()


def rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(outbox_table).order_by(outbox_table.c.id)))


def test_publish_writes_the_row_and_dispatches(
    outbox: Outbox, maker: sessionmaker[Session], engine: sa.Engine, fake: InMemoryBroker
) -> None:
    with maker.begin() as session:
        message_id = outbox.publish(
            session,
            "order.created",
            {"order_id": 7},
            key="7",
            headers={"traceparent": "00-abc-def-01"},
        )
        assert rows(engine) == []  # nothing flushed or committed by publish()
    (row,) = rows(engine)
    assert row.message_id == message_id
    assert uuid.UUID(message_id).version == 7
    assert orjson.loads(row.body) == {"order_id": 7}
    assert row.content_type == "application/json"
    assert row.key == "7"
    assert row.headers == {"traceparent": "00-abc-def-01"}
    assert row.producer == "orders"
    # written with no attempt; the dispatcher may already have marked it sent (attempt 1)
    assert (row.status, row.attempts) in {("pending", 0), ("sent", 1)}
    wait_for(lambda: statuses(engine).get(message_id) == "sent", what="row marked sent")
    (wire,) = fake.stored
    assert wire["id"] == message_id
    assert wire["headers"] == {"traceparent": "00-abc-def-01"}
    assert wire["producer"] == "orders"


def test_bytes_pass_through_and_custom_serializer(
    maker: sessionmaker[Session], engine: sa.Engine, fake: InMemoryBroker
) -> None:
    @dataclasses.dataclass
    class Upper:
        content_type: str = "text/plain"

        def dumps(self, value: Any) -> bytes:
            return str(value).upper().encode()

    outbox = Outbox(client=fake.client(), serializer=Upper())
    outbox.install(maker)
    with maker.begin() as session:
        outbox.publish(session, "s", b"\x00\xffraw")
        outbox.publish(session, "s", "hello")
    assert outbox.close()
    first, second = rows(engine)
    assert (bytes(first.body), first.content_type) == (b"\x00\xffraw", OCTET_STREAM)
    assert (bytes(second.body), second.content_type) == (b"HELLO", "text/plain")
    assert [m["body_encoding"] for m in fake.stored] == ["base64", "utf-8"]


def test_serialization_error(outbox: Outbox, maker: sessionmaker[Session]) -> None:
    with maker() as session, pytest.raises(SerializationError):
        outbox.publish(session, "s", {"x": object()})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"subject": "bad subject"}, "invalid subject"),
        ({"subject": "_qmq.internal"}, "invalid subject"),
        ({"message_id": "has space"}, "message id"),
        ({"message_id": "x" * 129}, "message id"),
        ({"key": "k" * 201}, "key"),
        ({"headers": {f"h{i}": "v" for i in range(65)}}, "headers"),
        ({"headers": {"n": 1}}, "strings"),
        ({"delay": timedelta(seconds=1), "deliver_at": datetime.now(UTC)}, "not both"),
        ({"deliver_at": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"delay": timedelta(seconds=-1)}, "negative"),
    ],
)
def test_invalid_messages(
    outbox: Outbox, maker: sessionmaker[Session], kwargs: dict[str, Any], match: str
) -> None:
    args: dict[str, Any] = {"subject": "ok.subject", **kwargs}
    subject = args.pop("subject")
    with maker() as session, pytest.raises(InvalidMessage, match=match):
        outbox.publish(session, subject, {}, **args)


def test_delay_and_deliver_at_reach_the_row(
    maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    outbox = Outbox(dispatch=False)
    outbox.install(maker)
    at = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    with maker.begin() as session:
        outbox.publish(session, "later", {}, deliver_at=at)
        before = datetime.now(UTC)
        outbox.publish(session, "later", {}, delay=timedelta(hours=2))
    first, second = rows(engine)
    assert first.deliver_at.replace(tzinfo=UTC) == at
    delayed = second.deliver_at.replace(tzinfo=UTC)
    assert before + timedelta(hours=2) - timedelta(seconds=5) < delayed
    assert delayed < before + timedelta(hours=2, seconds=5)
    assert first.status == "pending"  # dispatch=False: the compensator's job


def test_explicit_message_id_and_duplicate(outbox: Outbox, maker: sessionmaker[Session]) -> None:
    with maker.begin() as session:
        assert outbox.publish(session, "s", {}, message_id="order-7-created") == "order-7-created"
    with pytest.raises(sa.exc.IntegrityError), maker.begin() as session:
        outbox.publish(session, "s", {}, message_id="order-7-created")


def test_publish_needs_install(engine: sa.Engine, fake: InMemoryBroker) -> None:
    outbox = Outbox(client=fake.client())
    with Session(engine) as session, pytest.raises(ConfigurationError, match="install"):
        outbox.publish(session, "s", {})


def test_an_installed_engine_covers_its_copies_and_outlives_dispose(
    engine: sa.Engine, fake: InMemoryBroker
) -> None:
    """``dispose()`` gives the engine a new pool (after a fork, say); an
    ``execution_options()`` copy shares the engine's pool: publish works on both."""
    outbox = Outbox(client=fake.client())
    outbox.install(engine)
    engine.dispose()
    with Session(engine) as session, session.begin():
        first = outbox.publish(session, "s", {})
    with Session(engine.execution_options(logging_token="copy")) as session, session.begin():
        second = outbox.publish(session, "s", {})
    assert outbox.close()
    assert sorted(fake.ids) == sorted([first, second])


def test_outbox_needs_a_broker() -> None:
    with pytest.raises(ConfigurationError):
        Outbox()


def test_transactional_commits_and_rolls_back(
    outbox: Outbox, maker: sessionmaker[Session], engine: sa.Engine, fake: InMemoryBroker
) -> None:
    @outbox.transactional(maker)
    def place(session: Session, order_id: int, *, fail: bool = False) -> str:
        message_id = outbox.publish(session, "order.created", {"id": order_id})
        if fail:
            raise ValueError("declined")
        return message_id

    assert place.__name__ == "place"
    sent = place(1)
    with pytest.raises(ValueError, match="declined"):
        place(2, fail=True)
    assert outbox.close()
    assert list(statuses(engine)) == [sent]
    assert list(fake.ids) == [sent]


async def test_async_transactional(tmp_path: Path, fake: InMemoryBroker) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    sqlite_transactions(engine.sync_engine)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    maker = async_sessionmaker(engine, sync_session_class=sessionmaker())
    outbox = Outbox(async_client=fake.async_client(), app="orders")

    @outbox.transactional(maker)
    async def place(session: AsyncSession, order_id: int, fail: bool = False) -> str:
        message_id = outbox.publish(session, "order.created", {"id": order_id})
        if fail:
            raise ValueError("declined")
        return message_id

    sent = await place(1)
    with pytest.raises(ValueError, match="declined"):
        await place(2, True)
    assert await outbox.aclose()
    assert list(fake.ids) == [sent]
    async with engine.connect() as conn:
        result = await conn.execute(sa.select(outbox_table.c.message_id, outbox_table.c.status))
        assert [tuple(r) for r in result] == [(sent, "sent")]
    await engine.dispose()


def test_uuid7_is_ordered_and_versioned() -> None:
    ids = [uuid7() for _ in range(5000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert {u.version for u in ids} == {7}
    assert {u.variant for u in ids} == {uuid.RFC_4122}
    now_ms = datetime.now(UTC).timestamp() * 1000
    assert abs((ids[-1].int >> 80) - now_ms) < 5000
