"""The transaction matrix on every transport: exactly the committed messages are stored,
once; a compensator resend is deduplicated where the transport can (the qmq broker,
JetStream) and stored twice but handled once where it cannot (RabbitMQ).

Each case publishes on its own subject through ``Outbox(transport=...)`` on PostgreSQL,
commits a sentinel and drains the dispatcher; then the transport's copy is read back.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message, Outbox
from qmq_outbox.compensator import Compensator
from qmq_outbox.schema import outbox_table
from tests.integration.consumer_support import count, invoices, running, wait_for
from tests.support.outbox import statuses
from tests.transports.kits import Kit

pytestmark = pytest.mark.timeout(60)


class Boom(Exception):
    pass


class Env:
    """One case's outbox on ``kit``'s transport, a subject, and a counter for bodies."""

    def __init__(self, kit: Kit, engine: Engine, *groups: str) -> None:
        self.kit = kit
        self.engine = engine
        self.maker = sessionmaker(engine)
        self.subject = kit.subject()
        kit.prepare(self.subject, *groups)
        self.outbox = Outbox(transport=kit.transport(), app="matrix")
        self.outbox.install(self.maker)
        self.counter = itertools.count()

    def pub(self, session: Session | AsyncSession) -> str:
        n = next(self.counter)
        return self.outbox.publish(session, self.subject, {"order_id": f"o-{n}"})

    def assert_exactly(self, expected: list[str], sentinel: str) -> None:
        assert self.outbox.close()  # drained: every handed-off message has been sent
        every = [*expected, sentinel]
        assert statuses(self.engine, subject=self.subject) == dict.fromkeys(every, "sent")
        assert self.kit.stored(self.subject) == Counter(every)


@pytest.fixture
def env(kit: Kit, engine: Engine) -> Iterator[Env]:
    env = Env(kit, engine)
    yield env
    env.outbox.close()


def commit(e: Env) -> list[str]:
    with e.maker.begin() as s:
        return [e.pub(s), e.pub(s)]


def rollback(e: Env) -> list[str]:
    with e.maker() as s:
        e.pub(s)
        s.flush()
        s.rollback()
    return []


def exception_in_begin(e: Env) -> list[str]:
    def work() -> None:
        with e.maker.begin() as s:
            e.pub(s)
            s.flush()
            raise Boom

    with pytest.raises(Boom):
        work()
    return []


def savepoint_released(e: Env) -> list[str]:
    with e.maker.begin() as s:
        a = e.pub(s)
        with s.begin_nested():
            b = e.pub(s)
    return [a, b]


def savepoint_rolled_back(e: Env) -> list[str]:
    with e.maker.begin() as s:
        a = e.pub(s)
        savepoint = s.begin_nested()
        e.pub(s)
        s.flush()
        savepoint.rollback()
        c = e.pub(s)
    return [a, c]


def savepoint_released_outer_rollback(e: Env) -> list[str]:
    with e.maker() as s:
        e.pub(s)
        with s.begin_nested():
            e.pub(s)
        s.rollback()
    return []


CASES: dict[str, Callable[[Env], list[str]]] = {
    f.__name__: f
    for f in (
        commit,
        rollback,
        exception_in_begin,
        savepoint_released,
        savepoint_rolled_back,
        savepoint_released_outer_rollback,
    )
}


@pytest.mark.parametrize("case", list(CASES))
def test_session(env: Env, case: str) -> None:
    expected = CASES[case](env)
    with env.maker.begin() as s:
        sentinel = env.pub(s)
    env.assert_exactly(expected, sentinel)


async def test_async_session_commit_and_rolled_back_savepoint(
    kit: Kit, engine: Engine, transports_db: str
) -> None:
    """The asyncio dispatcher: the transport's producer on the application's loop."""
    async_engine = create_async_engine(transports_db)
    maker = async_sessionmaker(async_engine, expire_on_commit=False)
    env = Env(kit, engine)
    env.outbox.install(maker)
    try:
        async with maker.begin() as s:
            a = env.pub(s)
            savepoint = await s.begin_nested()
            env.pub(s)
            await s.flush()
            await savepoint.rollback()
        async with maker.begin() as s:
            sentinel = env.pub(s)
        assert await env.outbox.aclose()
        every = [a, sentinel]
        assert statuses(engine, subject=env.subject) == dict.fromkeys(every, "sent")
        assert kit.stored(env.subject) == Counter(every)
    finally:
        await async_engine.dispose()


def test_compensator_resend_is_deduplicated_or_handled_once(kit: Kit, engine: Engine) -> None:
    """Sent, then the rows' ``sent`` mark lost (a crash after the send): the compensator sends
    them again. Deduplicating transports store each once and answer ``duplicate``; RabbitMQ
    stores a second copy, and the idempotent consumer bills each order once all the same."""
    group = kit.group()
    env = Env(kit, engine, group)
    with env.maker.begin() as s:
        ids = [env.pub(s) for _ in range(3)]
    assert env.outbox.close()
    with engine.begin() as conn:  # as if the dispatcher died before marking them
        conn.execute(sa.update(outbox_table).values(status="pending", sent_at=None))

    compensator = Compensator(engine=engine, transport=kit.transport(), grace=timedelta(0))
    try:
        result = compensator.run_once()
    finally:
        compensator.stop(5)
    dedup = kit.transport().capabilities.dedup
    assert (result.sent, result.duplicates) == (3, 3 if dedup else 0)
    assert statuses(engine, subject=env.subject) == dict.fromkeys(ids, "sent")
    assert kit.stored(env.subject) == Counter(ids * (1 if dedup else 2))

    consumer = Consumer(transport=kit.transport(), group=group, wait_ms=200, ack_interval=0.02)
    store = IdempotentStore(sessionmaker(engine))

    def bill(message: Message, session: Session) -> None:
        order = message.json()["order_id"]
        session.execute(sa.insert(invoices).values(order_id=order, message_id=message.id, amount=1))

    consumer.add_handler(env.subject, bill, idempotent=store)
    with running(consumer):
        wait_for(
            lambda: (
                consumer.stats().processed + consumer.stats().duplicates
                == len(ids) * (1 if dedup else 2)
            ),
            what="every copy handled",
        )
    assert count(engine, invoices) == 3
    assert consumer.stats().processed == 3
    assert consumer.stats().duplicates == (0 if dedup else 3)
