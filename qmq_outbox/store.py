"""``OutboxStore``: the SQL the dispatcher and the compensator run on ``qmq_outbox``.

Primitives only (insert, claim, mark sent/retry/dead, purge, stats); each call runs in its
own short transaction on a connection of the store's engine, never on a caller's session.
Claims use ``FOR UPDATE SKIP LOCKED`` on PostgreSQL so several compensators can share a
table; on SQLite the same statement runs without it (one compensator at a time there).
Completions are fenced by the claim token: a claimant whose lease expired and was taken
over cannot complete the row. SQLAlchemy errors become ``OutboxStoreError`` here.
``AsyncOutboxStore`` runs the same statements on an ``AsyncEngine`` (``run_sync``).

None of these writes needs to survive a database crash (a lost claim or mark only causes a
resend, which the broker deduplicates), so on PostgreSQL they commit with
``synchronous_commit = off`` and do not wait for the WAL flush.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import OutboxStoreError
from qmq_outbox.schema import outbox_table as t


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClaimedRow:
    """A pending row claimed for sending: its id, the message and the attempt it is on."""

    id: int
    attempts: int
    message: OutgoingMessage


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """A failed row to try again at ``next_attempt_at`` (or to bury when out of attempts)."""

    id: int
    next_attempt_at: datetime


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PendingStats:
    count: int
    oldest_created_at: datetime | None


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes: they were written in UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


_ASYNC_COMMIT = sa.text("SET LOCAL synchronous_commit TO OFF")


@contextmanager
def _transaction(engine: Engine, what: str) -> Iterator[sa.Connection]:
    """A short transaction that does not wait for its commit to be flushed (PostgreSQL)."""
    with _translated(what), engine.begin() as conn:
        _no_flush_wait(conn)
        yield conn


def _no_flush_wait(conn: sa.Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(_ASYNC_COMMIT)


@contextmanager
def _translated(what: str) -> Iterator[None]:
    try:
        yield
    except sa.exc.SQLAlchemyError as exc:
        raise OutboxStoreError(f"outbox {what} failed: {exc}") from exc


_CLAIMED_COLUMNS = (
    t.c.id,
    t.c.attempts,
    t.c.message_id,
    t.c.subject,
    t.c.key,
    t.c.headers,
    t.c.body,
    t.c.producer,
    t.c.created_at,
    t.c.deliver_at,
)


def claim_statement(
    *,
    token: str,
    now: datetime,
    grace: timedelta,
    lease: timedelta,
    limit: int,
    dialect: str = "postgresql",
) -> sa.Update:
    """Due pending rows (older than ``grace`` on their first attempt), unclaimed or with an
    expired lease, oldest first; they get ``token``, a lease and one more attempt.

    On PostgreSQL the locked ids are collected with ``= ANY(ARRAY(...))``, evaluated once,
    so the update probes the primary key instead of hash-joining the whole table.
    """
    due = (
        sa.select(t.c.id)
        .where(
            t.c.status == "pending",
            t.c.next_attempt_at <= now,
            sa.or_(t.c.attempts > 0, t.c.created_at <= now - grace),
            sa.or_(t.c.claimed_until.is_(None), t.c.claimed_until < now),
        )
        .order_by(t.c.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)  # rendered on PostgreSQL only
    )
    chosen = (
        t.c.id == sa.any_(sa.func.array(due.scalar_subquery()))
        if dialect == "postgresql"
        else t.c.id.in_(due.scalar_subquery())
    )
    return (
        sa.update(t)
        .where(chosen)
        .values(claim_token=token, claimed_until=now + lease, attempts=t.c.attempts + 1)
        .returning(*_CLAIMED_COLUMNS)
    )


def _claimed(row: sa.Row[Any]) -> ClaimedRow:
    message = OutgoingMessage(
        id=row.message_id,
        subject=row.subject,
        body=bytes(row.body),
        key=row.key,
        headers=dict(row.headers or {}),
        producer=row.producer,
        created_at=as_utc(row.created_at),
        deliver_at=as_utc(row.deliver_at),
    )
    return ClaimedRow(id=row.id, attempts=row.attempts, message=message)


def ids_match(ids: Sequence[int], dialect: str) -> sa.ColumnElement[bool]:
    """``id IN (...)``; on PostgreSQL one array parameter instead of one per id."""
    if dialect == "postgresql":
        return t.c.id == sa.any_(
            sa.bindparam("ids", list(ids), type_=postgresql.ARRAY(sa.BigInteger))
        )
    return t.c.id.in_(list(ids))


def mark_sent_statement(
    *, ids: Sequence[int], token: str, now: datetime, dialect: str = "postgresql"
) -> sa.Update:
    return (
        sa.update(t)
        .where(ids_match(ids, dialect), t.c.claim_token == token, t.c.status == "pending")
        .values(status="sent", sent_at=now, claimed_until=None, last_error=None)
    )


def mark_sent_by_message_id_statement(*, message_ids: Sequence[str], now: datetime) -> sa.Update:
    return (
        sa.update(t)
        .where(t.c.message_id.in_(list(message_ids)), t.c.status == "pending")
        .values(status="sent", sent_at=now, attempts=t.c.attempts + 1)
    )


def mark_dead_by_message_id_statement(*, message_id: str, error: str) -> sa.Update:
    return (
        sa.update(t)
        .where(t.c.message_id == message_id, t.c.status == "pending")
        .values(status="dead", last_error=error, attempts=t.c.attempts + 1)
    )


class OutboxStore:
    """Blocking adapter over ``qmq_outbox`` on ``engine`` (which the caller owns)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def insert(self, rows: Sequence[dict[str, Any]]) -> None:
        """Insert fully specified rows in one transaction (bulk loads, tests, benchmarks)."""
        with _translated("insert"), self.engine.begin() as conn:
            conn.execute(sa.insert(t), list(rows))

    def claim(
        self, *, token: str, now: datetime, grace: timedelta, lease: timedelta, limit: int
    ) -> list[ClaimedRow]:
        stmt = claim_statement(
            token=token,
            now=now,
            grace=grace,
            lease=lease,
            limit=limit,
            dialect=self.engine.dialect.name,
        )
        with _transaction(self.engine, "claim") as conn:
            return [_claimed(row) for row in conn.execute(stmt)]

    def mark_sent(self, *, ids: Sequence[int], token: str, now: datetime) -> int:
        """Mark claimed rows sent; returns how many this claimant still held."""
        if not ids:
            return 0
        stmt = mark_sent_statement(ids=ids, token=token, now=now, dialect=self.engine.dialect.name)
        with _transaction(self.engine, "mark sent") as conn:
            return conn.execute(stmt).rowcount

    def mark_retry(self, *, retries: Sequence[Retry], token: str, error: str) -> None:
        """Release claimed rows for another attempt at their ``next_attempt_at``."""
        if not retries:
            return
        stmt = (
            sa.update(t)
            .where(
                t.c.id == sa.bindparam("b_id"),
                t.c.claim_token == token,
                t.c.status == "pending",
            )
            .values(
                next_attempt_at=sa.bindparam("b_next"),
                claimed_until=None,
                last_error=error,
            )
        )
        params = [{"b_id": r.id, "b_next": r.next_attempt_at} for r in retries]
        with _transaction(self.engine, "mark retry") as conn:
            conn.execute(stmt, params)

    def mark_dead(self, *, ids: Sequence[int], token: str, error: str) -> int:
        """Give up on claimed rows, keeping ``error`` in ``last_error``."""
        if not ids:
            return 0
        stmt = (
            sa.update(t)
            .where(
                ids_match(ids, self.engine.dialect.name),
                t.c.claim_token == token,
                t.c.status == "pending",
            )
            .values(status="dead", last_error=error, claimed_until=None)
        )
        with _transaction(self.engine, "mark dead") as conn:
            return conn.execute(stmt).rowcount

    def mark_dispatched(
        self, *, sent_ids: Sequence[str], dead: Sequence[tuple[str, str]], now: datetime
    ) -> int:
        """The dispatcher's completion of one send, by message id (its rows are unclaimed):
        ``sent_ids`` become *sent*, ``dead`` ``(message_id, error)`` pairs *dead*. Returns how
        many rows were marked sent."""
        if not sent_ids and not dead:
            return 0
        with _transaction(self.engine, "mark dispatched") as conn:
            return _mark_dispatched(conn, sent_ids=sent_ids, dead=dead, now=now)

    def purge_sent(self, *, before: datetime, batch_size: int) -> int:
        """Delete up to ``batch_size`` rows sent before ``before``; returns how many."""
        old = sa.select(t.c.id).where(t.c.status == "sent", t.c.sent_at < before).limit(batch_size)
        stmt = sa.delete(t).where(t.c.id.in_(old.scalar_subquery()))
        with _transaction(self.engine, "purge") as conn:
            return conn.execute(stmt).rowcount

    def pending_stats(self) -> PendingStats:
        stmt = sa.select(sa.func.count(), sa.func.min(t.c.created_at)).where(
            t.c.status == "pending"
        )
        with _translated("stats"), self.engine.connect() as conn:
            count, oldest = conn.execute(stmt).one()
        return PendingStats(count=int(count), oldest_created_at=as_utc(oldest))


class AsyncOutboxStore:
    """The dispatcher's completions for asyncio apps, on an ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def mark_dispatched(
        self, *, sent_ids: Sequence[str], dead: Sequence[tuple[str, str]], now: datetime
    ) -> int:
        """``OutboxStore.mark_dispatched``, the same statements through ``run_sync``."""
        if not sent_ids and not dead:
            return 0
        with _translated("mark dispatched"):
            async with self.engine.begin() as conn:
                await conn.run_sync(_no_flush_wait)
                return await conn.run_sync(_mark_dispatched, sent_ids=sent_ids, dead=dead, now=now)


def _mark_dispatched(
    conn: sa.Connection, *, sent_ids: Sequence[str], dead: Sequence[tuple[str, str]], now: datetime
) -> int:
    marked = 0
    if sent_ids:
        sent = mark_sent_by_message_id_statement(message_ids=sent_ids, now=now)
        marked = conn.execute(sent).rowcount
    for message_id, error in dead:
        conn.execute(mark_dead_by_message_id_statement(message_id=message_id, error=error))
    return marked
