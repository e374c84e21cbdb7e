"""IdempotentStore on PostgreSQL without a broker: racing twins, claims, GC, AsyncSession."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import IdempotentStore, Message
from qmq_outbox.idempotent import ClaimHeld, Outcome, rows
from qmq_outbox.schema import consumed_table
from tests.integration.consumer_support import consumer_database, count, effects, invoices, reset
from tests.support.messages import delivered

TWINS = 6


@pytest.fixture(scope="module")
def db_url(pg_admin_url: str) -> Iterator[str]:
    with consumer_database(pg_admin_url) as url:
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = sa.create_engine(db_url, pool_size=TWINS + 2)
    reset(engine)
    yield engine
    engine.dispose()


@pytest.fixture
async def async_sm(db_url: str, engine: Engine) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    url = make_url(db_url).set(drivername="postgresql+psycopg_async")
    async_engine = create_async_engine(url, pool_size=TWINS + 2)
    yield async_sessionmaker(async_engine)
    await async_engine.dispose()


def _msg(message_id: str = "m-1", attempt: int = 1) -> Message:
    return delivered("order.created", 0, message_id, b'{"order_id": "o-1"}', attempt)


def test_concurrent_twins_commit_one_effect(engine: Engine) -> None:
    """Every twin inserts the dedup row; all but the first wait for it, then skip."""
    store = IdempotentStore(sessionmaker(engine))
    start = threading.Barrier(TWINS)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def bill(message: Message, session: Session) -> None:
        session.execute(
            sa.insert(invoices).values(order_id="o-1", message_id=message.id, amount=10)
        )
        threading.Event().wait(0.05)  # keep the transaction open while the twins arrive

    def twin() -> None:
        start.wait(5)
        outcome = store.process("billing", _msg(), bill)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=twin) for _ in range(TWINS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert sorted(o.value for o in outcomes) == ["duplicate"] * (TWINS - 1) + ["processed"]
    assert count(engine, invoices) == 1
    assert count(engine, consumed_table) == 1


def test_a_twins_rollback_lets_the_waiting_one_proceed(engine: Engine) -> None:
    store = IdempotentStore(sessionmaker(engine))
    first_inside, order = threading.Event(), []

    def failing(message: Message, session: Session) -> None:
        session.execute(sa.insert(invoices).values(order_id="o-1", message_id="m-1", amount=1))
        first_inside.set()
        threading.Event().wait(0.3)
        raise RuntimeError("first attempt fails")

    def succeeding(message: Message, session: Session) -> None:
        order.append("second")
        session.execute(sa.insert(invoices).values(order_id="o-1", message_id="m-1", amount=2))

    def first() -> None:
        with pytest.raises(RuntimeError):
            store.process("billing", _msg(), failing)

    thread = threading.Thread(target=first)
    thread.start()
    assert first_inside.wait(5)
    assert store.process("billing", _msg(attempt=2), succeeding) is Outcome.PROCESSED
    thread.join(5)
    assert order == ["second"]
    with engine.connect() as conn:
        assert conn.execute(sa.select(invoices.c.amount)).scalar_one() == 2


def test_non_transactional_on_postgres(engine: Engine) -> None:
    clock_now = [datetime(2030, 1, 1, tzinfo=UTC)]
    store = IdempotentStore(sessionmaker(engine), clock=lambda: clock_now[0])
    nt = store.non_transactional(lease=timedelta(seconds=30))
    inside = threading.Event()
    proceed = threading.Event()

    def effect(message: Message) -> None:
        with engine.begin() as conn:
            conn.execute(sa.insert(effects).values(message_id=message.id, attempt=message.attempt))
        inside.set()
        proceed.wait(5)

    holder = threading.Thread(target=lambda: nt.process("g", _msg(), effect))
    holder.start()
    assert inside.wait(5)
    with pytest.raises(ClaimHeld) as held:
        nt.process("g", _msg(attempt=2), effect)
    assert held.value.retry_after > timedelta(seconds=29)
    proceed.set()
    holder.join(5)
    assert nt.process("g", _msg(attempt=3), effect) is Outcome.DUPLICATE
    assert count(engine, effects) == 1
    # a holder that died: its claim expires and the message is processed again
    with engine.begin() as conn:
        now = clock_now[0]
        conn.execute(
            *rows.insert_processing("g", "m-2", now=now, until=now + timedelta(seconds=30))
        )
    clock_now[0] += timedelta(seconds=31)
    proceed.set()
    assert nt.process("g", _msg("m-2"), effect) is Outcome.PROCESSED
    assert count(engine, effects, message_id="m-2") == 1


def test_gc_on_postgres(engine: Engine) -> None:
    clock_now = [datetime(2030, 1, 1, tzinfo=UTC)]
    store = IdempotentStore(
        sessionmaker(engine), retention=timedelta(days=1), clock=lambda: clock_now[0]
    )
    for index in range(25):
        store.process("g", _msg(f"m-{index}"), lambda m, s: None)
    clock_now[0] += timedelta(days=2)
    store.process("g", _msg("fresh"), lambda m, s: None)
    assert store.gc(batch_size=10) == 25
    assert count(engine, consumed_table) == 1


async def test_async_twins_on_postgres(
    async_sm: async_sessionmaker[AsyncSession], engine: Engine
) -> None:
    store = IdempotentStore(async_sm)

    async def bill(message: Message, session: AsyncSession) -> None:
        await session.execute(
            sa.insert(invoices).values(order_id="o-1", message_id=message.id, amount=10)
        )
        await asyncio.sleep(0.05)

    outcomes = await asyncio.gather(*(store.process_async("g", _msg(), bill) for _ in range(TWINS)))
    assert sorted(o.value for o in outcomes) == ["duplicate"] * (TWINS - 1) + ["processed"]
    assert count(engine, invoices) == 1
    nt = store.non_transactional()
    seen: list[str] = []

    async def effect(message: Message) -> None:
        seen.append(message.id)

    assert await nt.process_async("g", _msg("x"), effect) is Outcome.PROCESSED
    assert await nt.process_async("g", _msg("x"), effect) is Outcome.DUPLICATE
    assert seen == ["x"]


def test_overlapping_batches_on_twins_commit_each_message_once(engine: Engine) -> None:
    """Two consumers hold overlapping batches (leases expired): every message's effect once,
    and no deadlock, because batches insert their dedup rows in message-id order."""
    store = IdempotentStore(sessionmaker(engine), batch_size=16)
    batches = [
        [_msg(f"m-{i:02d}") for i in range(0, 12)],
        [_msg(f"m-{i:02d}") for i in reversed(range(6, 18))],
    ]
    start = threading.Barrier(2)
    results: list[list[object]] = []

    def bill(message: Message, session: Session) -> None:
        session.execute(
            sa.insert(invoices).values(order_id=message.id, message_id=message.id, amount=1)
        )

    def twin(batch: list[Message]) -> None:
        start.wait(5)
        results.append(list(store.process_batch("billing", batch, bill)))

    threads = [threading.Thread(target=twin, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert count(engine, invoices) == 18
    flat = [outcome for result in results for outcome in result]
    assert flat.count(Outcome.PROCESSED) == 18
    assert flat.count(Outcome.DUPLICATE) == 6


def test_a_batch_inserts_its_dedup_rows_in_one_statement_of_constant_text(engine: Engine) -> None:
    """A batch's dedup rows are one INSERT, its text the same whatever the batch's size (the
    driver prepares it once); a message already consumed, or twice in the batch, runs once."""
    store = IdempotentStore(sessionmaker(engine), batch_size=8)
    dedup_inserts: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.startswith("INSERT INTO qmq_consumed"):
            dedup_inserts.append(statement)

    ran: list[str] = []

    def bill(message: Message, session: Session) -> None:
        ran.append(message.id)

    first = store.process_batch("g", [_msg("a"), _msg("b"), _msg("b")], bill)
    second = store.process_batch("g", [_msg(f"{n}") for n in "abcde"], bill)
    sa.event.remove(engine, "before_cursor_execute", seen)
    assert first == [Outcome.PROCESSED, Outcome.PROCESSED, Outcome.DUPLICATE]
    assert second == [Outcome.DUPLICATE, Outcome.DUPLICATE, *[Outcome.PROCESSED] * 3]
    assert ran == ["a", "b", "c", "d", "e"]
    assert len(dedup_inserts) == 2
    assert dedup_inserts[0] == dedup_inserts[1]
