"""IdempotentStore on SQLite (sync and aiosqlite): dedup, rollback, claims, leases, GC."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import IdempotentStore, Message
from qmq_outbox.idempotent import ClaimHeld, Outcome, rows
from qmq_outbox.schema import consumed_table, metadata
from tests.support.messages import delivered

business = sa.MetaData()
invoices = sa.Table(
    "invoices",
    business,
    sa.Column("order_id", sa.String(50), primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
)


class SteppingClock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kwargs: float) -> None:
        self.now += timedelta(**kwargs)


def _msg(message_id: str = "m-1") -> Message:
    return delivered("order.created", 0, message_id, b'{"order_id": "o-1"}', 1)


@pytest.fixture
def clock() -> SteppingClock:
    return SteppingClock()


@pytest.fixture
def sm(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'store.db'}")
    metadata.create_all(engine)
    business.create_all(engine)
    yield sessionmaker(engine)
    engine.dispose()


@pytest.fixture
async def asm(tmp_path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'store.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.run_sync(business.create_all)
    yield async_sessionmaker(engine)
    await engine.dispose()


def _count(sm: sessionmaker[Session], table: sa.Table) -> int:
    with sm() as session:
        return int(session.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def _bill(message: Message, session: Session) -> None:
    session.execute(sa.insert(invoices).values(order_id=message.json()["order_id"], amount=10))


def test_a_redelivered_message_is_skipped(sm: sessionmaker[Session]) -> None:
    store = IdempotentStore(sm)
    assert store.process("billing", _msg(), _bill) is Outcome.PROCESSED
    assert store.process("billing", _msg(), _bill) is Outcome.DUPLICATE
    assert _count(sm, invoices) == 1
    assert _count(sm, consumed_table) == 1


def test_each_group_consumes_once(sm: sessionmaker[Session]) -> None:
    store = IdempotentStore(sm)
    calls: list[str] = []
    store.process("billing", _msg(), lambda m, s: calls.append("billing"))
    store.process("shipping", _msg(), lambda m, s: calls.append("shipping"))
    store.process("shipping", _msg(), lambda m, s: calls.append("again"))
    assert calls == ["billing", "shipping"]


def test_a_failing_handler_rolls_back_its_writes_and_the_dedup_row(
    sm: sessionmaker[Session],
) -> None:
    store = IdempotentStore(sm)

    def half_done(message: Message, session: Session) -> None:
        _bill(message, session)
        raise RuntimeError("payment gateway down")

    with pytest.raises(RuntimeError, match="gateway"):
        store.process("billing", _msg(), half_done)
    assert _count(sm, invoices) == 0
    assert _count(sm, consumed_table) == 0
    assert store.process("billing", _msg(), _bill) is Outcome.PROCESSED
    assert _count(sm, invoices) == 1


def test_the_handlers_own_unique_violation_is_its_failure_not_a_duplicate(
    sm: sessionmaker[Session],
) -> None:
    store = IdempotentStore(sm)
    store.process("billing", _msg("m-1"), _bill)
    with pytest.raises(IntegrityError, match="invoices"):
        store.process("billing", _msg("m-2"), _bill)  # same order, another message
    assert _count(sm, consumed_table) == 1


def test_gc_deletes_only_rows_past_the_retention(
    sm: sessionmaker[Session], clock: SteppingClock
) -> None:
    store = IdempotentStore(sm, retention=timedelta(days=7), clock=clock)
    for index in range(5):
        store.process("g", _msg(f"old-{index}"), lambda m, s: None)
    _leave_claim(sm, clock, timedelta(minutes=1))  # its holder never came back
    clock.advance(days=6)
    store.process("g", _msg("young"), lambda m, s: None)
    clock.advance(days=2)
    assert store.gc(batch_size=2) == 6
    with sm() as session:
        left = session.execute(sa.select(consumed_table.c.message_id)).scalars().all()
    assert left == ["young"]


def test_non_transactional_records_processing_then_done(
    sm: sessionmaker[Session], clock: SteppingClock
) -> None:
    nt = IdempotentStore(sm, clock=clock).non_transactional(lease=timedelta(seconds=30))
    states: list[tuple[str, Any]] = []

    def effect(message: Message) -> None:
        with sm() as session:
            row = session.execute(*rows.select_state("g", message.id)).one()
            states.append((row.status, row.lease_until))

    assert nt.process("g", _msg(), effect) is Outcome.PROCESSED
    assert states[0][0] == "processing"
    assert rows.as_utc(states[0][1]) == clock.now + timedelta(seconds=30)
    with sm() as session:
        row = session.execute(*rows.select_state("g", "m-1")).one()
        assert (row.status, row.lease_until) == ("done", None)
    assert nt.process("g", _msg(), effect) is Outcome.DUPLICATE
    assert len(states) == 1


def test_non_transactional_failure_releases_the_claim(
    sm: sessionmaker[Session], clock: SteppingClock
) -> None:
    nt = IdempotentStore(sm, clock=clock).non_transactional()
    calls = 0

    def flaky(message: Message) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("smtp down")

    with pytest.raises(ConnectionError):
        nt.process("g", _msg(), flaky)
    assert _count(sm, consumed_table) == 0
    assert nt.process("g", _msg(), flaky) is Outcome.PROCESSED
    assert calls == 2


def _leave_claim(sm: sessionmaker[Session], clock: SteppingClock, lease: timedelta) -> None:
    """The state a consumer killed mid-handler leaves: a processing row with a lease."""
    with sm() as session, session.begin():
        session.execute(*rows.insert_processing("g", "m-1", now=clock.now, until=clock.now + lease))


def test_a_live_twins_claim_means_retry_after_its_lease(
    sm: sessionmaker[Session], clock: SteppingClock
) -> None:
    nt = IdempotentStore(sm, clock=clock).non_transactional(lease=timedelta(seconds=30))
    _leave_claim(sm, clock, timedelta(seconds=30))
    clock.advance(seconds=10)
    with pytest.raises(ClaimHeld) as held:
        nt.process("g", _msg(), lambda m: pytest.fail("must not run while the twin holds it"))
    assert held.value.retry_after == timedelta(seconds=20, milliseconds=100)


def test_a_dead_holders_expired_claim_is_processed_again_not_skipped(
    sm: sessionmaker[Session], clock: SteppingClock
) -> None:
    nt = IdempotentStore(sm, clock=clock).non_transactional(lease=timedelta(seconds=30))
    _leave_claim(sm, clock, timedelta(seconds=30))
    clock.advance(seconds=31)
    ran: list[str] = []
    assert nt.process("g", _msg(), lambda m: ran.append(m.id)) is Outcome.PROCESSED
    assert ran == ["m-1"]


def test_a_late_failure_does_not_release_the_twin_that_took_over(
    sm: sessionmaker[Session], clock: SteppingClock
) -> None:
    store = IdempotentStore(sm, clock=clock)
    nt = store.non_transactional(lease=timedelta(seconds=5))

    def slow_then_fail(message: Message) -> None:
        clock.advance(seconds=6)  # our lease runs out; a twin takes the message over
        with sm() as session, session.begin():
            until = clock.now + timedelta(seconds=5)
            session.execute(*rows.take_over_expired("g", message.id, now=clock.now, until=until))
        raise RuntimeError("late failure")

    with pytest.raises(RuntimeError):
        nt.process("g", _msg(), slow_then_fail)
    with sm() as session:
        assert session.execute(*rows.select_state("g", "m-1")).one().status == "processing"


def test_duplicate_mapping_by_constraint_name() -> None:
    def error(name: str | None, text: str = "") -> IntegrityError:
        orig: Any = Exception(text)
        if name is not None:
            orig.diag = SimpleNamespace(constraint_name=name)
        return IntegrityError("INSERT", {}, orig)

    assert rows.is_duplicate(error("pk_qmq_consumed"))
    assert not rows.is_duplicate(error("uq_invoices_order_id"))
    assert rows.is_duplicate(error(None, "UNIQUE constraint failed: qmq_consumed.message_id"))
    assert not rows.is_duplicate(error(None, "NOT NULL constraint failed: qmq_consumed.status"))


def test_the_dedup_key_is_named_pk_qmq_consumed() -> None:
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.schema import CreateTable

    ddl = str(CreateTable(consumed_table).compile(dialect=postgresql.dialect()))  # type: ignore[no-untyped-call]
    assert "CONSTRAINT pk_qmq_consumed PRIMARY KEY (consumer_group, message_id)" in ddl


async def _abill(message: Message, session: AsyncSession) -> None:
    await session.execute(sa.insert(invoices).values(order_id="o-1", amount=10))


async def test_async_store_dedups_and_rolls_back(
    asm: async_sessionmaker[AsyncSession],
) -> None:
    store = IdempotentStore(asm)
    assert store.is_async

    async def failing(message: Message, session: AsyncSession) -> None:
        await _abill(message, session)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await store.process_async("g", _msg(), failing)
    assert await store.process_async("g", _msg(), _abill) is Outcome.PROCESSED
    assert await store.process_async("g", _msg(), _abill) is Outcome.DUPLICATE
    async with asm() as session:
        assert (
            await session.execute(sa.select(sa.func.count()).select_from(invoices))
        ).scalar() == 1


async def test_async_non_transactional_and_gc(
    asm: async_sessionmaker[AsyncSession], clock: SteppingClock
) -> None:
    store = IdempotentStore(asm, clock=clock, retention=timedelta(hours=1))
    nt = store.non_transactional(lease=timedelta(seconds=10))
    seen: list[str] = []

    async def effect(message: Message) -> None:
        seen.append(message.id)

    assert await nt.process_async("g", _msg(), effect) is Outcome.PROCESSED
    assert await nt.process_async("g", _msg(), effect) is Outcome.DUPLICATE
    assert (
        await nt.process_async("g", _msg("m-2"), lambda m: seen.append(m.id)) is Outcome.PROCESSED
    )
    async with asm() as session, session.begin():
        await session.execute(
            *rows.insert_processing(
                "g", "m-3", now=clock.now, until=clock.now + timedelta(seconds=10)
            )
        )
    with pytest.raises(ClaimHeld):
        await nt.process_async("g", _msg("m-3"), effect)
    clock.advance(seconds=11)
    assert await nt.process_async("g", _msg("m-3"), effect) is Outcome.PROCESSED
    assert seen == ["m-1", "m-2", "m-3"]
    clock.advance(hours=2)
    assert await store.gc_async() == 3


def test_a_batch_commits_new_messages_together_and_skips_known_ones(
    sm: sessionmaker[Session],
) -> None:
    store = IdempotentStore(sm, batch_size=8)
    seen: list[str] = []

    def record(message: Message, session: Session) -> None:
        seen.append(message.id)
        session.execute(sa.insert(invoices).values(order_id=message.id, amount=1))

    first = [_msg("a"), _msg("b")]
    assert store.process_batch("g", first, record) == [Outcome.PROCESSED] * 2
    again = [_msg("b"), _msg("c"), _msg("a"), _msg("c")]
    assert store.process_batch("g", again, record) == [
        Outcome.DUPLICATE,
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,  # the same message twice in one batch runs once
    ]
    assert seen == ["a", "b", "c"]
    assert _count(sm, invoices) == 3


def test_a_failure_in_a_batch_fails_only_its_message(sm: sessionmaker[Session]) -> None:
    store = IdempotentStore(sm, batch_size=8)
    calls: list[str] = []

    def picky(message: Message, session: Session) -> None:
        calls.append(message.id)
        session.execute(sa.insert(invoices).values(order_id=message.id, amount=1))
        if message.id == "bad":
            raise ValueError("bad order")

    results = store.process_batch("g", [_msg("x"), _msg("bad"), _msg("y")], picky)
    assert results[0] is Outcome.PROCESSED
    assert isinstance(results[1], ValueError)
    assert results[2] is Outcome.PROCESSED
    assert calls == ["x", "bad", "x", "bad", "y"]  # rolled back, then one by one
    with sm() as session:
        ids = set(session.execute(sa.select(consumed_table.c.message_id)).scalars())
    assert ids == {"x", "y"}
    assert _count(sm, invoices) == 2


def test_a_dialect_without_on_conflict_falls_back_to_one_by_one(
    sm: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rows, "insert_done_many", lambda *args, **kwargs: None)
    store = IdempotentStore(sm, batch_size=4)
    assert store.process_batch("g", [_msg("a"), _msg("b")], lambda m, s: None) == [
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ]
    assert store.process_batch("g", [_msg("a")], lambda m, s: None) == [Outcome.DUPLICATE]


async def test_async_batches(asm: async_sessionmaker[AsyncSession]) -> None:
    store = IdempotentStore(asm, batch_size=4)

    async def handler(message: Message, session: AsyncSession) -> None:
        if message.id == "boom":
            raise RuntimeError("boom")

    results = await store.process_batch_async("g", [_msg("a"), _msg("boom"), _msg("b")], handler)
    assert results[0] is Outcome.PROCESSED
    assert isinstance(results[1], RuntimeError)
    assert await store.process_batch_async("g", [_msg("a"), _msg("b")], handler) == [
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
    ]


def test_batch_size_must_be_positive(sm: sessionmaker[Session]) -> None:
    from qmq_outbox.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        IdempotentStore(sm, batch_size=0)
