"""The transaction matrix (issue 4), on PostgreSQL and SQLite, with Session and AsyncSession.

Every case publishes on its own subject to a real broker process, commits a sentinel
message, and drains the dispatcher (``close``): whatever was handed to it, rightly or
wrongly, has then been sent. The test proves that exactly the committed messages (and the
sentinel) were stored, once, by reading the subject back on a fresh group.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from qmq_outbox import migrate
from qmq_outbox.client import BrokerClient
from qmq_outbox.compensator import Compensator
from qmq_outbox.outbox import Outbox
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import (
    sqlite_transactions,
    statuses,
    stored_ids,
    unique_subject,
)
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(60)


class Base(DeclarativeBase):
    pass


class Note(Base):
    """A business row of the application's own, flushed by the unit of work."""

    __tablename__ = "matrix_notes"
    id: Mapped[int] = mapped_column(primary_key=True)
    text: Mapped[str]


def row_count(session: Session, message_id: str) -> int:
    """How many outbox rows of ``message_id`` the session's transaction sees."""
    query = sa.text("SELECT count(*) FROM qmq_outbox WHERE message_id = :id")
    return int(session.execute(query, {"id": message_id}).scalar_one())


class Boom(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Database:
    name: str
    url: str
    async_url: str


@pytest.fixture(scope="module")
def broker_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(tmp_path_factory.mktemp("matrix-broker") / "data").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pg_database(pg_admin_url: str) -> Iterator[Database]:
    with fresh_database(pg_admin_url, prefix="qmq_outbox_matrix") as url:
        migrate.upgrade(url)
        yield Database("postgresql", url, url)


@pytest.fixture(scope="module")
def sqlite_database(tmp_path_factory: pytest.TempPathFactory) -> Database:
    path = tmp_path_factory.mktemp("matrix-sqlite") / "app.db"
    migrate.upgrade(f"sqlite:///{path}")
    return Database("sqlite", f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}")


@pytest.fixture(params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest) -> Database:
    db: Database = request.getfixturevalue(
        f"{'pg' if request.param == 'postgresql' else 'sqlite'}_database"
    )
    return db


def make_engine(db: Database) -> sa.Engine:
    engine = sa.create_engine(db.url)
    return sqlite_transactions(engine) if db.name == "sqlite" else engine


@dataclasses.dataclass
class Env:
    """One test's outbox, sessionmaker, subject, and a blocking engine to inspect rows."""

    db: Database
    outbox: Outbox
    maker: sessionmaker[Session]
    check: sa.Engine
    client: BrokerClient
    broker_url: str
    subject: str = dataclasses.field(default_factory=unique_subject)
    counter: Iterator[int] = dataclasses.field(default_factory=itertools.count)

    def pub(self, session: Session | AsyncSession) -> str:
        return self.outbox.publish(session, self.subject, {"n": next(self.counter)})

    def compensate(self) -> None:
        comp = Compensator(engine=self.check, broker_url=self.broker_url, grace=timedelta(0))
        try:
            comp.run_once()
        finally:
            comp.stop(1)

    def assert_exactly(self, expected: list[str], sentinel: str) -> None:
        assert self.outbox.close()  # drained: every handed-off message has been sent
        self.assert_stored(expected, sentinel)

    def assert_stored(self, expected: list[str], sentinel: str) -> None:
        assert statuses(self.check, subject=self.subject) == dict.fromkeys(
            [*expected, sentinel], "sent"
        )
        assert stored_ids(self.client, self.subject) == Counter([*expected, sentinel])


@dataclasses.dataclass
class AsyncEnv(Env):
    async_maker: async_sessionmaker[AsyncSession] | None = None
    engine: AsyncEngine | None = None

    @property
    def amaker(self) -> async_sessionmaker[AsyncSession]:
        assert self.async_maker is not None
        return self.async_maker

    async def drain(self) -> None:
        assert await self.outbox.aclose()  # drained: every handed-off message has been sent


@pytest.fixture
def client(broker_proc: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(broker_proc.url) as client:
        yield client


@pytest.fixture
def env(database: Database, broker_proc: BrokerProcess, client: BrokerClient) -> Iterator[Env]:
    engine = make_engine(database)
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker_proc.url, app="matrix")
    outbox.install(maker)
    yield Env(database, outbox, maker, engine, client, broker_proc.url)
    assert outbox.close()
    engine.dispose()


@pytest.fixture
async def aenv(
    database: Database, broker_proc: BrokerProcess, client: BrokerClient
) -> AsyncIterator[AsyncEnv]:
    engine = create_async_engine(database.async_url)
    if database.name == "sqlite":
        sqlite_transactions(engine.sync_engine)
    amaker = async_sessionmaker(engine, sync_session_class=sessionmaker(), expire_on_commit=False)
    outbox = Outbox(broker_url=broker_proc.url, app="matrix")
    outbox.install(amaker)
    check = sa.create_engine(database.url)  # plain reads: never hold a lock the loop waits on
    yield AsyncEnv(
        database,
        outbox,
        sessionmaker(check),
        check,
        client,
        broker_proc.url,
        async_maker=amaker,
        engine=engine,
    )
    assert await outbox.aclose()
    await engine.dispose()
    check.dispose()


# -- Session ----------------------------------------------------------------------------------


def s_commit(e: Env) -> list[str]:
    with e.maker.begin() as s:
        return [e.pub(s), e.pub(s)]


def s_rollback(e: Env) -> list[str]:
    with e.maker() as s:
        e.pub(s)
        s.flush()
        s.rollback()
    return []


def s_close_without_commit(e: Env) -> list[str]:
    s = e.maker()
    e.pub(s)
    s.flush()
    s.close()
    return []


def s_exception_in_begin(e: Env) -> list[str]:
    def work() -> None:
        with e.maker.begin() as s:
            e.pub(s)
            s.flush()
            raise Boom

    with pytest.raises(Boom):
        work()
    return []


def s_savepoint_released_outer_commit(e: Env) -> list[str]:
    with e.maker.begin() as s:
        a = e.pub(s)
        with s.begin_nested():
            b = e.pub(s)
    return [a, b]


def s_savepoint_released_outer_rollback(e: Env) -> list[str]:
    with e.maker() as s:
        e.pub(s)
        with s.begin_nested():
            e.pub(s)
        s.rollback()
    return []


def s_savepoint_rolled_back_outer_commit(e: Env) -> list[str]:
    with e.maker.begin() as s:
        a = e.pub(s)
        savepoint = s.begin_nested()
        e.pub(s)
        s.flush()
        savepoint.rollback()
        c = e.pub(s)
    return [a, c]


def s_two_nested_savepoints(e: Env) -> list[str]:
    with e.maker.begin() as s:
        a = e.pub(s)
        with s.begin_nested():
            b = e.pub(s)
            inner = s.begin_nested()
            e.pub(s)
            s.flush()
            inner.rollback()
            with s.begin_nested():
                d = e.pub(s)
        outer = s.begin_nested()
        e.pub(s)
        with s.begin_nested():
            e.pub(s)
        outer.rollback()
    return [a, b, d]


def s_outer_row_written_in_a_rolled_back_savepoint(e: Env) -> list[str]:
    with e.maker.begin() as s:
        a = e.pub(s)
        outer = s.begin_nested()
        with s.begin_nested():
            e.pub(s)  # this RELEASE writes a's row too, inside ``outer``
        outer.rollback()  # takes a's row along: it is written again before COMMIT
    return [a]


def s_rows_of_a_session_with_orm_changes(e: Env) -> list[str]:
    Base.metadata.create_all(e.check)
    with e.maker.begin() as s:
        a = e.pub(s)
        assert row_count(s, a) == 0  # a query without ORM changes to flush: not in yet
        s.add(Note(text="x"))
        s.flush()  # a real flush: a's row goes in with it
        assert row_count(s, a) == 1
        b = e.pub(s)
    return [a, b]


def s_commit_with_savepoint_open(e: Env) -> list[str]:
    with e.maker() as s:
        a = e.pub(s)
        s.begin_nested()
        b = e.pub(s)
        s.commit()
    return [a, b]


def s_transactional_returns(e: Env) -> list[str]:
    @e.outbox.transactional(e.maker)
    def handler(session: Session) -> str:
        return e.pub(session)

    return [handler()]


def s_transactional_raises(e: Env) -> list[str]:
    @e.outbox.transactional(e.maker)
    def handler(session: Session) -> None:
        e.pub(session)
        session.flush()
        raise Boom

    with pytest.raises(Boom):
        handler()
    return []


SYNC_CASES: dict[str, Callable[[Env], list[str]]] = {
    f.__name__[2:]: f
    for f in (
        s_commit,
        s_rollback,
        s_close_without_commit,
        s_exception_in_begin,
        s_savepoint_released_outer_commit,
        s_savepoint_released_outer_rollback,
        s_savepoint_rolled_back_outer_commit,
        s_two_nested_savepoints,
        s_outer_row_written_in_a_rolled_back_savepoint,
        s_rows_of_a_session_with_orm_changes,
        s_commit_with_savepoint_open,
        s_transactional_returns,
        s_transactional_raises,
    )
}


@pytest.mark.parametrize("case", list(SYNC_CASES))
def test_session(env: Env, case: str) -> None:
    expected = SYNC_CASES[case](env)
    with env.maker.begin() as s:
        sentinel = env.pub(s)
    env.assert_exactly(expected, sentinel)


@pytest.mark.parametrize("mode", ["create_savepoint", "rollback_only"])
@pytest.mark.parametrize("outer", ["commit", "rollback"])
def test_session_joined_to_outside_transaction(env: Env, mode: str, outer: str) -> None:
    with env.check.connect() as conn:
        trans = conn.begin()
        session = env.maker(bind=conn, join_transaction_mode=mode)  # type: ignore[arg-type]
        message_id = env.pub(session)
        session.commit()  # not durable: must not dispatch
        session.close()
        getattr(trans, outer)()
    with env.maker.begin() as s:
        sentinel = env.pub(s)
    assert env.outbox.close()
    if outer == "commit":
        assert statuses(env.check, subject=env.subject)[message_id] == "pending"
        env.compensate()
    env.assert_stored([message_id] if outer == "commit" else [], sentinel)


# -- AsyncSession -----------------------------------------------------------------------------


async def a_commit(e: AsyncEnv) -> list[str]:
    async with e.amaker.begin() as s:
        return [e.pub(s), e.pub(s)]


async def a_rollback(e: AsyncEnv) -> list[str]:
    async with e.amaker() as s:
        e.pub(s)
        await s.flush()
        await s.rollback()
    return []


async def a_close_without_commit(e: AsyncEnv) -> list[str]:
    s = e.amaker()
    e.pub(s)
    await s.flush()
    await s.close()
    return []


async def a_exception_in_begin(e: AsyncEnv) -> list[str]:
    async def work() -> None:
        async with e.amaker.begin() as s:
            e.pub(s)
            await s.flush()
            raise Boom

    with pytest.raises(Boom):
        await work()
    return []


async def a_savepoint_released_outer_commit(e: AsyncEnv) -> list[str]:
    async with e.amaker.begin() as s:
        a = e.pub(s)
        async with s.begin_nested():
            b = e.pub(s)
    return [a, b]


async def a_savepoint_released_outer_rollback(e: AsyncEnv) -> list[str]:
    async with e.amaker() as s:
        e.pub(s)
        async with s.begin_nested():
            e.pub(s)
        await s.rollback()
    return []


async def a_savepoint_rolled_back_outer_commit(e: AsyncEnv) -> list[str]:
    async with e.amaker.begin() as s:
        a = e.pub(s)
        savepoint = await s.begin_nested()
        e.pub(s)
        await s.flush()
        await savepoint.rollback()
        c = e.pub(s)
    return [a, c]


async def a_two_nested_savepoints(e: AsyncEnv) -> list[str]:
    async with e.amaker.begin() as s:
        a = e.pub(s)
        async with s.begin_nested():
            b = e.pub(s)
            inner = await s.begin_nested()
            e.pub(s)
            await s.flush()
            await inner.rollback()
            async with s.begin_nested():
                d = e.pub(s)
        outer = await s.begin_nested()
        e.pub(s)
        async with s.begin_nested():
            e.pub(s)
        await outer.rollback()
    return [a, b, d]


async def a_outer_row_written_in_a_rolled_back_savepoint(e: AsyncEnv) -> list[str]:
    async with e.amaker.begin() as s:
        a = e.pub(s)
        outer = await s.begin_nested()
        async with s.begin_nested():
            e.pub(s)  # this RELEASE writes a's row too, inside ``outer``
        await outer.rollback()  # takes a's row along: it is written again before COMMIT
    return [a]


async def a_commit_with_savepoint_open(e: AsyncEnv) -> list[str]:
    async with e.amaker() as s:
        a = e.pub(s)
        await s.begin_nested()
        b = e.pub(s)
        await s.commit()
    return [a, b]


async def a_transactional_returns(e: AsyncEnv) -> list[str]:
    @e.outbox.transactional(e.amaker)
    async def handler(session: AsyncSession) -> str:
        return e.pub(session)

    return [await handler()]


async def a_transactional_raises(e: AsyncEnv) -> list[str]:
    @e.outbox.transactional(e.amaker)
    async def handler(session: AsyncSession) -> None:
        e.pub(session)
        await session.flush()
        raise Boom

    with pytest.raises(Boom):
        await handler()
    return []


ASYNC_CASES: dict[str, Callable[[AsyncEnv], Awaitable[list[str]]]] = {
    f.__name__[2:]: f
    for f in (
        a_commit,
        a_rollback,
        a_close_without_commit,
        a_exception_in_begin,
        a_savepoint_released_outer_commit,
        a_savepoint_released_outer_rollback,
        a_savepoint_rolled_back_outer_commit,
        a_two_nested_savepoints,
        a_outer_row_written_in_a_rolled_back_savepoint,
        a_commit_with_savepoint_open,
        a_transactional_returns,
        a_transactional_raises,
    )
}


@pytest.mark.parametrize("case", list(ASYNC_CASES))
async def test_async_session(aenv: AsyncEnv, case: str) -> None:
    expected = await ASYNC_CASES[case](aenv)
    async with aenv.amaker.begin() as s:
        sentinel = aenv.pub(s)
    await aenv.drain()
    aenv.assert_stored(expected, sentinel)


@pytest.mark.parametrize("mode", ["create_savepoint", "rollback_only"])
@pytest.mark.parametrize("outer", ["commit", "rollback"])
async def test_async_session_joined_to_outside_transaction(
    aenv: AsyncEnv, mode: str, outer: str
) -> None:
    assert aenv.engine is not None
    async with aenv.engine.connect() as conn:
        trans = await conn.begin()
        session = aenv.amaker(bind=conn, join_transaction_mode=mode)  # type: ignore[arg-type]
        message_id = aenv.pub(session)
        await session.commit()
        await session.close()
        await getattr(trans, outer)()
    async with aenv.amaker.begin() as s:
        sentinel = aenv.pub(s)
    await aenv.drain()
    if outer == "commit":
        assert statuses(aenv.check, subject=aenv.subject)[message_id] == "pending"
        aenv.compensate()
    aenv.assert_stored([message_id] if outer == "commit" else [], sentinel)
