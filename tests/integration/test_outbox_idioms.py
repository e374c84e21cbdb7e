"""The session idioms people write, with ``outbox.install(engine)`` and nothing else
(issue 18): ``Session(engine)``, ``sessionmaker(engine)()``, ``async_sessionmaker(engine)()``
and ``AsyncSession(engine)``, on PostgreSQL and SQLite, against a real broker process.

For each idiom: a commit gets the row written and the message stored by the broker (read
back on a fresh group), a rollback leaves neither, and a session bound to an engine that was
not installed is refused. The scoping of the class-wide listeners is checked at the end.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import migrate
from qmq_outbox.client import BrokerClient
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.outbox import Outbox
from qmq_outbox.tracking import TransactionTracker
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import sqlite_transactions, statuses, stored_ids, unique_subject
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(60)

SYNC_IDIOMS: dict[str, Callable[[sa.Engine], Session]] = {
    "Session(engine)": lambda engine: Session(engine),
    "sessionmaker(engine)()": lambda engine: sessionmaker(engine)(),
}
ASYNC_IDIOMS: dict[str, Callable[[AsyncEngine], AsyncSession]] = {
    "async_sessionmaker(engine)()": lambda engine: async_sessionmaker(engine)(),
    "AsyncSession(engine)": lambda engine: AsyncSession(engine),
}


@dataclasses.dataclass(frozen=True)
class Database:
    name: str
    url: str
    async_url: str

    def engine(self) -> sa.Engine:
        engine = sa.create_engine(self.url)
        return sqlite_transactions(engine) if self.name == "sqlite" else engine

    def async_engine(self) -> AsyncEngine:
        engine = create_async_engine(self.async_url)
        if self.name == "sqlite":
            sqlite_transactions(engine.sync_engine)
        return engine


@pytest.fixture(scope="module")
def broker_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(tmp_path_factory.mktemp("idioms-broker") / "data").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pg_database(pg_admin_url: str) -> Iterator[Database]:
    with fresh_database(pg_admin_url, prefix="qmq_outbox_idioms") as url:
        migrate.upgrade(url)
        yield Database("postgresql", url, url)


@pytest.fixture(scope="module")
def sqlite_database(tmp_path_factory: pytest.TempPathFactory) -> Database:
    path: Path = tmp_path_factory.mktemp("idioms-sqlite") / "app.db"
    migrate.upgrade(f"sqlite:///{path}")
    return Database("sqlite", f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}")


@pytest.fixture(params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest) -> Database:
    db: Database = request.getfixturevalue(
        "pg_database" if request.param == "postgresql" else "sqlite_database"
    )
    return db


@pytest.fixture
def client(broker_proc: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(broker_proc.url) as client:
        yield client


@pytest.fixture
def check(database: Database) -> Iterator[sa.Engine]:
    """A blocking engine to read rows with; never installed."""
    engine = sa.create_engine(database.url)
    yield engine
    engine.dispose()


@pytest.fixture
def engine(database: Database) -> Iterator[sa.Engine]:
    engine = database.engine()
    yield engine
    engine.dispose()


@pytest.fixture
async def async_engine(database: Database) -> AsyncIterator[AsyncEngine]:
    engine = database.async_engine()
    yield engine
    await engine.dispose()


@pytest.fixture
def outbox(broker_proc: BrokerProcess, engine: sa.Engine) -> Iterator[Outbox]:
    outbox = Outbox(broker_url=broker_proc.url, app="idioms")
    outbox.install(engine)
    yield outbox
    outbox.uninstall(engine)
    assert outbox.close()


@pytest.fixture
async def async_outbox(
    broker_proc: BrokerProcess, async_engine: AsyncEngine
) -> AsyncIterator[Outbox]:
    outbox = Outbox(broker_url=broker_proc.url, app="idioms")
    outbox.install(async_engine)
    yield outbox
    outbox.uninstall(async_engine)
    assert await outbox.aclose()


def assert_outcome(check: sa.Engine, client: BrokerClient, subject: str, sent: list[str]) -> None:
    """Exactly ``sent`` have a row marked sent and are stored once; nothing else exists."""
    assert statuses(check, subject=subject) == dict.fromkeys(sent, "sent")
    assert stored_ids(client, subject) == Counter(sent)


# -- sync -------------------------------------------------------------------------------------


@pytest.mark.parametrize("idiom", list(SYNC_IDIOMS))
def test_sync_commit_sends(
    idiom: str, outbox: Outbox, engine: sa.Engine, check: sa.Engine, client: BrokerClient
) -> None:
    subject = unique_subject()
    with SYNC_IDIOMS[idiom](engine) as session:
        message_id = outbox.publish(session, subject, {"n": 1})
        session.commit()
    assert outbox.close()  # drained: whatever was handed off has been sent
    assert_outcome(check, client, subject, [message_id])


@pytest.mark.parametrize("idiom", list(SYNC_IDIOMS))
def test_sync_rollback_leaves_nothing(
    idiom: str, outbox: Outbox, engine: sa.Engine, check: sa.Engine, client: BrokerClient
) -> None:
    subject = unique_subject()
    with SYNC_IDIOMS[idiom](engine) as session:
        outbox.publish(session, subject, {"n": 1})
        session.flush()
        session.rollback()
    with SYNC_IDIOMS[idiom](engine) as session:
        outbox.publish(session, subject, {"n": 2})
        session.flush()  # closed without commit
    assert outbox.close()
    assert_outcome(check, client, subject, [])


@pytest.mark.parametrize("idiom", list(SYNC_IDIOMS))
def test_sync_session_of_another_engine_is_refused(
    idiom: str, outbox: Outbox, database: Database
) -> None:
    other = database.engine()  # same database, but not the installed engine
    try:
        with (
            SYNC_IDIOMS[idiom](other) as session,
            pytest.raises(ConfigurationError, match=r"outbox\.install\(engine\)"),
        ):
            outbox.publish(session, unique_subject(), {})
    finally:
        other.dispose()


# -- async ------------------------------------------------------------------------------------


@pytest.mark.parametrize("idiom", list(ASYNC_IDIOMS))
async def test_async_commit_sends(
    idiom: str,
    async_outbox: Outbox,
    async_engine: AsyncEngine,
    check: sa.Engine,
    client: BrokerClient,
) -> None:
    subject = unique_subject()
    async with ASYNC_IDIOMS[idiom](async_engine) as session:
        message_id = async_outbox.publish(session, subject, {"n": 1})
        await session.commit()
    assert await async_outbox.aclose()
    assert_outcome(check, client, subject, [message_id])


@pytest.mark.parametrize("idiom", list(ASYNC_IDIOMS))
async def test_async_rollback_leaves_nothing(
    idiom: str,
    async_outbox: Outbox,
    async_engine: AsyncEngine,
    check: sa.Engine,
    client: BrokerClient,
) -> None:
    subject = unique_subject()
    async with ASYNC_IDIOMS[idiom](async_engine) as session:
        async_outbox.publish(session, subject, {"n": 1})
        await session.flush()
        await session.rollback()
    async with ASYNC_IDIOMS[idiom](async_engine) as session:
        async_outbox.publish(session, subject, {"n": 2})
        await session.flush()  # closed without commit
    assert await async_outbox.aclose()
    assert_outcome(check, client, subject, [])


@pytest.mark.parametrize("idiom", list(ASYNC_IDIOMS))
async def test_async_session_of_another_engine_is_refused(
    idiom: str, async_outbox: Outbox, database: Database
) -> None:
    other = database.async_engine()
    try:
        async with ASYNC_IDIOMS[idiom](other) as session:
            with pytest.raises(ConfigurationError, match=r"outbox\.install\(engine\)"):
                async_outbox.publish(session, unique_subject(), {})
    finally:
        await other.dispose()


async def test_async_sessionmaker_installs_its_engine(
    broker_proc: BrokerProcess, async_engine: AsyncEngine, check: sa.Engine, client: BrokerClient
) -> None:
    """``install(async_sessionmaker(engine))`` and ``@transactional`` on it need no
    ``sync_session_class``: the maker stands for its engine."""
    maker = async_sessionmaker(async_engine)
    outbox = Outbox(broker_url=broker_proc.url, app="idioms")
    subject = unique_subject()

    @outbox.transactional(maker)
    async def place(session: AsyncSession) -> str:
        return outbox.publish(session, subject, {"n": 1})

    try:
        message_id = await place()
        async with AsyncSession(async_engine) as session:  # same engine, another session
            second = outbox.publish(session, subject, {"n": 2})
            await session.commit()
    finally:
        outbox.uninstall(maker)
    assert await outbox.aclose()
    assert_outcome(check, client, subject, [message_id, second])


# -- scoping ----------------------------------------------------------------------------------


def test_binds_made_from_an_installed_engine_are_accepted(
    outbox: Outbox, engine: sa.Engine, check: sa.Engine, client: BrokerClient
) -> None:
    subject = unique_subject()
    with Session(engine.execution_options(logging_token="copy")) as session:
        copied = outbox.publish(session, subject, {"n": 1})
        session.commit()
    with engine.connect() as conn, Session(bind=conn) as session:
        outbox.publish(session, subject, {"n": 2})  # accepted, then rolled back with conn
        session.flush()
    assert outbox.close()
    assert_outcome(check, client, subject, [copied])


def test_session_wide_listeners_exist_only_while_an_engine_is_installed(
    sqlite_database: Database,
) -> None:
    engine = sqlite_database.engine()
    tracker: TransactionTracker[str] = TransactionTracker(lambda items: None)
    hooks = (Session, "after_transaction_end", tracker._session_wide_end)
    try:
        tracker.install(sessionmaker(engine))
        assert not sa.event.contains(*hooks)  # a sessionmaker: nothing on Session
        tracker.install(engine)
        tracker.install(engine)
        assert sa.event.contains(*hooks)
        tracker.uninstall(engine)
        assert not sa.event.contains(*hooks)
    finally:
        tracker.uninstall(engine)
        engine.dispose()


def test_one_hand_off_when_both_the_engine_and_a_sessionmaker_are_installed(
    sqlite_database: Database,
) -> None:
    engine = sqlite_database.engine()
    handoffs: list[list[str]] = []
    tracker: TransactionTracker[str] = TransactionTracker(handoffs.append)
    maker = sessionmaker(engine)
    tracker.install(maker)
    tracker.install(engine)
    try:
        with maker.begin() as session:
            tracker.stage(session, "from the maker")
        with Session(engine) as session, session.begin():
            tracker.stage(session, "from Session(engine)")
        other = sa.create_engine(sqlite_database.url)
        with Session(other) as session:
            assert not tracker.is_installed(session)
        other.dispose()
    finally:
        tracker.uninstall(engine)
        tracker.uninstall(maker)
        engine.dispose()
    assert handoffs == [["from the maker"], ["from Session(engine)"]]
