"""The transaction-tracking rules (``docs/outbox.md``, "What is sent, and when"), no broker.

Each test stages tagged items through a ``TransactionTracker`` on a real SQLite database and
checks exactly which items reach ``on_commit``, and in how many hand-offs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from qmq_outbox.errors import ConfigurationError
from qmq_outbox.tracking import TransactionTracker
from tests.support.outbox import sqlite_transactions


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    tag: Mapped[str]


class Recorder:
    def __init__(self) -> None:
        self.handoffs: list[list[str]] = []
        self.tracker: TransactionTracker[str] = TransactionTracker(self.handoffs.append)

    def publish(self, session: Session, tag: str) -> None:
        session.add(Order(tag=tag))
        self.tracker.stage(session, tag)

    @property
    def items(self) -> list[str]:
        return [tag for handoff in self.handoffs for tag in handoff]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sqlite_transactions(sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def maker(engine: sa.Engine) -> sessionmaker[Session]:
    return sessionmaker(engine)


@pytest.fixture
def rec(maker: sessionmaker[Session]) -> Recorder:
    recorder = Recorder()
    recorder.tracker.install(maker)
    return recorder


def committed_tags(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(Order.tag)))


def test_commit_hands_off_once(rec: Recorder, maker: sessionmaker[Session]) -> None:
    with maker.begin() as session:
        rec.publish(session, "a")
        rec.publish(session, "b")
    assert rec.handoffs == [["a", "b"]]


def test_rollback_discards(rec: Recorder, maker: sessionmaker[Session]) -> None:
    with maker() as session:
        rec.publish(session, "a")
        session.rollback()
        session.commit()  # a logical empty commit after the rollback hands off nothing
    assert rec.handoffs == []


def test_close_without_commit_discards(rec: Recorder, maker: sessionmaker[Session]) -> None:
    session = maker()
    rec.publish(session, "a")
    session.close()
    assert rec.handoffs == []
    assert rec.tracker.staged(session) == 0
    with session.begin():  # the same Session object, reused: nothing stale leaks in
        rec.publish(session, "b")
    assert rec.handoffs == [["b"]]


def test_exception_inside_begin_discards(rec: Recorder, maker: sessionmaker[Session]) -> None:
    def work() -> None:
        with maker.begin() as session:
            rec.publish(session, "a")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        work()
    assert rec.handoffs == []


def test_released_savepoint_goes_out_with_outer_commit(
    rec: Recorder, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker.begin() as session:
        rec.publish(session, "a")
        with session.begin_nested():
            rec.publish(session, "b")
        assert rec.handoffs == []  # RELEASE fired after_commit: still nothing sent
    assert rec.handoffs == [["a", "b"]]
    assert committed_tags(engine) == {"a", "b"}


def test_released_savepoint_then_outer_rollback(
    rec: Recorder, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker() as session:
        with session.begin_nested():
            rec.publish(session, "b")
        session.rollback()
    assert rec.handoffs == []
    assert committed_tags(engine) == set()


def test_rolled_back_savepoint_then_outer_commit(
    rec: Recorder, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker.begin() as session:
        rec.publish(session, "a")
        savepoint = session.begin_nested()
        rec.publish(session, "b")
        savepoint.rollback()
        rec.publish(session, "c")
    assert rec.handoffs == [["a", "c"]]
    assert committed_tags(engine) == {"a", "c"}


def test_two_nested_savepoints(
    rec: Recorder, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker.begin() as session:
        rec.publish(session, "a")
        with session.begin_nested():
            rec.publish(session, "b")
            inner = session.begin_nested()
            rec.publish(session, "c")
            inner.rollback()
            with session.begin_nested():
                rec.publish(session, "d")
        outer = session.begin_nested()
        rec.publish(session, "e")
        with session.begin_nested():
            rec.publish(session, "f")  # released into a savepoint that rolls back
        outer.rollback()
    assert rec.handoffs == [["a", "b", "d"]]
    assert committed_tags(engine) == {"a", "b", "d"}


def test_commit_with_savepoint_open_dispatches_once(
    rec: Recorder, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    after_commits: list[int] = []
    sa.event.listen(maker, "after_commit", lambda s: after_commits.append(1))
    with maker() as session:
        rec.publish(session, "a")
        session.begin_nested()
        rec.publish(session, "b")
        session.commit()
    assert len(after_commits) == 2  # the trap: RELEASE and COMMIT both fire it
    assert rec.handoffs == [["a", "b"]]
    assert committed_tags(engine) == {"a", "b"}


def test_autobegin_and_flushes_inside_transaction(
    rec: Recorder, maker: sessionmaker[Session]
) -> None:
    with maker() as session:
        rec.publish(session, "a")
        session.flush()  # flush subtransactions begin and end: no effect
        rec.publish(session, "b")
        session.execute(sa.select(Order)).all()  # autoflush
        session.commit()
        rec.publish(session, "c")  # a new autobegun transaction on the same session
        session.commit()
    assert rec.handoffs == [["a", "b"], ["c"]]


@pytest.mark.parametrize("mode", ["create_savepoint", "rollback_only"])
@pytest.mark.parametrize("outer", ["commit", "rollback"])
def test_external_transaction_is_left_to_the_relay(
    engine: sa.Engine, maker: sessionmaker[Session], mode: str, outer: str
) -> None:
    """A session joined to an outside transaction still fires after_commit on its root.

    The tracker hands the items off (it only knows about the session's own transactions);
    ``Outbox`` recognises the Connection bind and leaves them to the compensator.
    """
    rec = Recorder()
    rec.tracker.install(maker)
    with engine.connect() as conn:
        trans = conn.begin()
        session = maker(bind=conn, join_transaction_mode=mode)  # type: ignore[arg-type]
        rec.publish(session, "a")
        session.commit()
        session.close()
        assert rec.handoffs == [["a"]]
        assert isinstance(session.bind, sa.Connection)
        getattr(trans, outer)()
    assert committed_tags(engine) == ({"a"} if outer == "commit" else set())


def test_install_is_idempotent_and_scoped(engine: sa.Engine, maker: sessionmaker[Session]) -> None:
    rec = Recorder()
    rec.tracker.install(maker)
    rec.tracker.install(maker)
    rec.tracker.install(maker.class_)
    other = sessionmaker(engine)
    with maker.begin() as session:
        rec.publish(session, "a")
    assert rec.handoffs == [["a"]]
    with other() as session:
        assert not rec.tracker.is_installed(session)
    assert not sa.event.contains(Session, "after_commit", rec.tracker._after_commit)


def test_refuses_the_global_session_class() -> None:
    tracker: TransactionTracker[str] = TransactionTracker(lambda items: None)
    with pytest.raises(ConfigurationError, match="global"):
        tracker.install(Session)
    with pytest.raises(ConfigurationError, match="sync_session_class"):
        tracker.install(async_sessionmaker())
    with pytest.raises(ConfigurationError):
        tracker.install(object())


def test_uninstall(rec: Recorder, maker: sessionmaker[Session]) -> None:
    rec.tracker.uninstall(maker)
    with maker.begin() as session:
        assert not rec.tracker.is_installed(session)


def test_instance_install(engine: sa.Engine) -> None:
    rec = Recorder()
    with Session(engine) as session:
        rec.tracker.install(session)
        assert rec.tracker.is_installed(session)
        rec.publish(session, "a")
        session.commit()
    assert rec.handoffs == [["a"]]


def test_on_commit_errors_never_reach_the_caller(
    maker: sessionmaker[Session], engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(items: list[str]) -> None:
        raise RuntimeError("dispatcher exploded")

    tracker: TransactionTracker[str] = TransactionTracker(explode)
    tracker.install(maker)
    with maker.begin() as session:
        session.add(Order(tag="a"))
        tracker.stage(session, "a")
    assert committed_tags(engine) == {"a"}
    assert any(getattr(r, "action", "") == "outbox.handoff_failed" for r in caplog.records)


async def test_async_session_commit_and_savepoints(tmp_path: Path) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    sqlite_transactions(engine.sync_engine)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    rec = Recorder()
    maker = async_sessionmaker(engine, sync_session_class=sessionmaker())
    rec.tracker.install(maker)
    async with maker() as session:
        async with session.begin():
            rec.publish(session.sync_session, "a")
            async with session.begin_nested():
                rec.publish(session.sync_session, "b")
            savepoint = await session.begin_nested()
            rec.publish(session.sync_session, "c")
            await savepoint.rollback()
        assert rec.handoffs == [["a", "b"]]
        rec.publish(session.sync_session, "d")
        await session.rollback()
    async with maker() as session:
        rec.publish(session.sync_session, "e")  # closed without commit
    assert rec.handoffs == [["a", "b"]]
    await engine.dispose()


# -- a writer: items written before COMMIT, and written again when a savepoint undoes them ---


class Writer:
    """Stages tags with a ``write`` that inserts them as ``orders`` rows, as the outbox
    writes its rows: nothing is added to the session's unit of work."""

    def __init__(self) -> None:
        self.handoffs: list[list[str]] = []
        self.writes: list[list[str]] = []
        self.tracker: TransactionTracker[str] = TransactionTracker(
            self.handoffs.append, write=self.write
        )

    def write(self, session: Session, tags: list[str]) -> None:
        self.writes.append(tags)
        session.execute(sa.insert(Order), [{"tag": tag} for tag in tags])


@pytest.fixture
def writer(maker: sessionmaker[Session]) -> Writer:
    writer = Writer()
    writer.tracker.install(maker)
    return writer


def test_written_before_commit_in_a_session_without_orm_changes(
    writer: Writer, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker() as session:
        writer.tracker.stage(session, "a")
        writer.tracker.stage(session, "b")
        session.flush()  # nothing of the unit of work to flush: SQLAlchemy skips it
        assert writer.writes == []
        session.commit()
    assert writer.writes == [["a", "b"]]  # one write, right before COMMIT
    assert writer.handoffs == [["a", "b"]]
    assert committed_tags(engine) == {"a", "b"}


def test_written_with_a_flush_of_orm_changes(
    writer: Writer, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker.begin() as session:
        writer.tracker.stage(session, "a")
        session.add(Order(tag="orm"))
        session.flush()
        assert writer.writes == [["a"]]
        writer.tracker.stage(session, "b")
    assert writer.writes == [["a"], ["b"]]
    assert writer.handoffs == [["a", "b"]]
    assert committed_tags(engine) == {"a", "b", "orm"}


def test_a_rolled_back_savepoint_takes_outer_writes_along_and_they_are_made_again(
    writer: Writer, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker.begin() as session:
        writer.tracker.stage(session, "a")
        outer = session.begin_nested()
        with session.begin_nested():
            writer.tracker.stage(session, "b")
        assert writer.writes == [["a", "b"]]  # the inner RELEASE wrote both, inside outer
        writer.tracker.stage(session, "c")
        outer.rollback()  # undoes a's and b's rows; b and c were outer's own
        writer.tracker.stage(session, "d")
    assert writer.writes == [["a", "b"], ["a", "d"]]
    assert writer.handoffs == [["a", "d"]]
    assert committed_tags(engine) == {"a", "d"}


def test_a_released_savepoint_keeps_its_writes(
    writer: Writer, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    with maker() as session:
        writer.tracker.stage(session, "a")
        with session.begin_nested():
            with session.begin_nested():
                writer.tracker.stage(session, "b")
            writer.tracker.stage(session, "c")
        session.commit()
    assert writer.writes == [["a", "b"], ["c"]]
    assert writer.handoffs == [["a", "b", "c"]]
    assert committed_tags(engine) == {"a", "b", "c"}


def test_a_failed_write_leaves_its_items_to_be_written(
    writer: Writer, maker: sessionmaker[Session], engine: sa.Engine
) -> None:
    failures = iter([RuntimeError("refused")])
    write = writer.write

    def flaky(session: Session, tags: list[str]) -> None:
        if (failure := next(failures, None)) is not None:
            raise failure
        write(session, tags)

    writer.tracker._write = flaky
    with maker.begin() as session:
        writer.tracker.stage(session, "a")
        with pytest.raises(RuntimeError), session.begin_nested():
            writer.tracker.stage(session, "b")  # the RELEASE's write fails: rolled back
        writer.tracker.stage(session, "c")
    assert writer.handoffs == [["a", "c"]]
    assert committed_tags(engine) == {"a", "c"}


def test_an_item_staged_after_the_commits_write_is_not_handed_off(
    writer: Writer,
    maker: sessionmaker[Session],
    engine: sa.Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with maker() as session:
        writer.tracker.stage(session, "a")
        session.add(Order(tag="orm"))  # so that the commit flushes
        sa.event.listen(session, "after_flush", lambda s, _: writer.tracker.stage(s, "late"))
        session.commit()
    assert writer.handoffs == [["a"]]  # "late" has no row: it must not be sent
    assert committed_tags(engine) == {"a", "orm"}
    assert "staged during the commit" in caplog.text
