"""``OutboxStore``: the SQL the dispatcher and the compensator run on ``qmq_outbox``.

Primitives only (insert, claim, mark sent/retry/dead, purge, stats); each call runs in its
own short transaction on a connection of the store's engine, never on a caller's session.
Claims use ``FOR UPDATE SKIP LOCKED`` on PostgreSQL so several compensators can share a
table; on SQLite the same statement runs without it (one compensator at a time there).
Completions are fenced by the claim token: a claimant whose lease expired and was taken
over cannot complete the row. SQLAlchemy errors become ``OutboxStoreError`` here.
``AsyncOutboxStore`` runs the same statements on an ``AsyncEngine`` (``run_sync``).

Per-key order (docs/outbox.md, "Per-key order"): a keyed row may go out only when every
earlier row of its (subject, key) is ``sent`` or ``dead`` or goes out before it in the same
send. The claim takes a row only with all earlier pending rows of its key (those it cannot
take hold it back, and leave the LIMIT to other keys); ``order_check`` tells the dispatcher
which of its keyed rows may go now. Both probe ``ix_qmq_outbox_pending_key``, which holds
only pending keyed rows; unkeyed rows pass every key test at once.

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
class NotDue:
    """Pending rows a claim passes over: in their grace (first attempt, the dispatcher's
    turn) or waiting for a retry; and when the first of them falls due."""

    in_grace: int
    retrying: int
    next_due_at: datetime | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SubjectBacklog:
    """A subject's rows that still need someone: pending (and the oldest one's creation
    time) and dead (``OutboxStore.backlog``)."""

    subject: str
    pending: int
    oldest_pending_at: datetime | None
    dead: int


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
    with translated(what), engine.begin() as conn:
        _no_flush_wait(conn)
        yield conn


def _no_flush_wait(conn: sa.Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(_ASYNC_COMMIT)


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Raise the database's errors within as ``OutboxStoreError`` (``outbox <what> failed``)."""
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
    t.c.tags,
)


# A key's first pending row, in the claim's probe.
_HEAD = t.alias("head")
# A literal, not a parameter: the planner proves a partial index's predicate only from
# constants (PostgreSQL's generic plans, SQLite always).
_PENDING: sa.ColumnElement[str] = sa.literal_column("'pending'", sa.String())


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

    A keyed row is taken only with every earlier pending row of its (subject, key):
    - before the LIMIT, keys with a pending row that is not due (a retry waiting, or rows
      another claim holds: claiming a keyed row moves its ``next_attempt_at`` to the end of
      the lease) are passed over whole, so the LIMIT goes to keys that can move; so are rows
      due before their key's first pending row (behind a retried one): in this scan's order
      (by ``next_attempt_at``) a key's first row then always comes before the rest, and a
      LIMIT full of rows that must wait for it cannot starve it;
    - after it, a key's rows from the first earlier pending row this claim did not get
      (LIMIT, SKIP LOCKED, a row in its grace) are dropped: locked until the claim commits,
      not updated, seen again by the next claim.
    Unkeyed rows pass these tests untouched.

    On PostgreSQL a key's first row is looked up once per key (a LATERAL join the planner
    memoizes), and the chosen ids are collected with ``= ANY(ARRAY(...))``, evaluated once,
    so the update probes the primary key instead of hash-joining the whole table.
    """
    waiting_keys = (
        sa.select(t.c.subject, t.c.key)
        .where(t.c.status == "pending", t.c.next_attempt_at > now, t.c.key.is_not(None))
        .distinct()
    )
    rows, head_first = _behind_head(dialect)
    in_key_order = sa.and_(  # the cheap test first: it turns away most held-back rows
        sa.tuple_(t.c.subject, t.c.key).not_in(waiting_keys), head_first
    )
    due = (
        sa.select(t.c.id, t.c.subject, t.c.key)
        .select_from(rows)
        .where(
            t.c.status == "pending",
            t.c.next_attempt_at <= now,
            sa.or_(t.c.attempts > 0, t.c.created_at <= now - grace),
            sa.or_(t.c.claimed_until.is_(None), t.c.claimed_until < now),
            sa.or_(t.c.key.is_(None), in_key_order),
        )
        .order_by(t.c.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True, of=t)  # rendered on PostgreSQL only
        .cte("due")
    )
    kept = _before_first_left_out(due, sa.select(due.c.id))
    chosen = (
        t.c.id == sa.any_(sa.func.array(kept.scalar_subquery()))
        if dialect == "postgresql"
        else t.c.id.in_(kept.scalar_subquery())
    )
    lease_end = now + lease
    return (
        sa.update(t)
        .where(chosen)
        .values(
            claim_token=token,
            claimed_until=lease_end,
            attempts=t.c.attempts + 1,
            # Unkeyed rows keep theirs, so their claim stays a HOT update.
            next_attempt_at=sa.case((t.c.key.is_(None), t.c.next_attempt_at), else_=lease_end),
        )
        .returning(*_CLAIMED_COLUMNS)
    )


def _behind_head(dialect: str) -> tuple[sa.FromClause, sa.ColumnElement[bool]]:
    """The rows to scan and the test that a keyed row is its key's first pending row or
    not due before it."""
    if dialect == "postgresql":
        head = (
            sa.select(_HEAD.c.id, _HEAD.c.next_attempt_at)
            .where(
                _HEAD.c.subject == t.c.subject,
                _HEAD.c.key == t.c.key,
                _HEAD.c.key.is_not(None),
                _HEAD.c.status == _PENDING,
            )
            .order_by(_HEAD.c.id)
            .limit(1)
            .lateral("key_head")
        )
        rows = t.outerjoin(head, t.c.key.is_not(None))
        return rows, sa.or_(head.c.id == t.c.id, head.c.next_attempt_at <= t.c.next_attempt_at)
    head_later = sa.exists().where(
        _HEAD.c.id == _first_pending(t),
        _HEAD.c.id < t.c.id,
        _HEAD.c.next_attempt_at > t.c.next_attempt_at,
    )
    return t, ~head_later


def _first_pending(
    of: sa.FromClause, *, besides: sa.Select[tuple[int]] | None = None
) -> sa.ScalarSelect[int]:
    """The id of the first pending row of ``of``'s (subject, key), leaving out ``besides``:
    one probe of ``ix_qmq_outbox_pending_key`` (spelled so PostgreSQL proves its predicate),
    walking past the ids in ``besides``."""
    first = t.alias("first")
    conditions = [
        first.c.subject == of.c.subject,
        first.c.key == of.c.key,
        first.c.key.is_not(None),
        first.c.status == _PENDING,
    ]
    if besides is not None:
        conditions.append(first.c.id.not_in(besides))
    found = sa.select(sa.func.min(first.c.id)).where(*conditions)
    return found.correlate_except(first).scalar_subquery()  # ``of`` may be two levels up


def _before_first_left_out(rows: sa.CTE, ids: sa.Select[tuple[int]]) -> sa.Select[tuple[int]]:
    """The ids of ``rows`` (a CTE of id, subject, key) that may go in id order: unkeyed
    ones, and keyed ones below their key's first pending row outside ``ids``. Computed once
    per key, not per row, so a key's walk past its own rows is paid once."""
    keys = (
        sa.select(rows.c.subject, rows.c.key)
        .where(rows.c.key.is_not(None))
        .distinct()
        .subquery("keys")
    )
    cut = sa.select(
        keys.c.subject, keys.c.key, _first_pending(keys, besides=ids).label("left_out")
    ).cte(f"{rows.name}_cut")
    same_key = sa.and_(cut.c.subject == rows.c.subject, cut.c.key == rows.c.key)
    return (
        sa.select(rows.c.id)
        .select_from(rows.outerjoin(cut, same_key))
        .where(sa.or_(cut.c.left_out.is_(None), rows.c.id < cut.c.left_out))
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OrderCheck:
    """Which of a send's keyed messages may go now (``order_check``).

    ``sendable``: message id → outbox id of the rows that may go, in outbox id order per key;
    ``held``: pending rows behind an earlier unsent row of their key outside the send;
    ``settled``: messages whose row is no longer pending (sent or dead meanwhile) or absent.
    """

    sendable: dict[str, int]
    held: frozenset[str]
    settled: frozenset[str]


def order_check_statement(*, message_ids: Sequence[str]) -> sa.Select[Any]:
    """The send's rows, each with ``may_go``: below its key's first pending row outside
    the send. Rows no longer pending come back too, to tell them from absent ones."""
    batch = (
        sa.select(t.c.id, t.c.message_id, t.c.subject, t.c.key, t.c.status)
        .where(t.c.message_id.in_(list(message_ids)))
        .cte("batch")
    )
    may_go = _before_first_left_out(batch, sa.select(batch.c.id)).subquery("may_go")
    return sa.select(
        batch.c.id, batch.c.message_id, batch.c.status, may_go.c.id.is_not(None).label("may_go")
    ).select_from(batch.outerjoin(may_go, may_go.c.id == batch.c.id))


def _order_check(conn: sa.Connection, *, message_ids: Sequence[str]) -> OrderCheck:
    rows = conn.execute(order_check_statement(message_ids=message_ids)).all()
    sendable: dict[str, int] = {}
    held: set[str] = set()
    for row in sorted(rows, key=lambda r: r.id):
        if row.status != "pending":
            continue
        if row.may_go:
            sendable[row.message_id] = row.id
        else:
            held.add(row.message_id)
    settled = set(message_ids) - held - set(sendable)
    return OrderCheck(sendable=sendable, held=frozenset(held), settled=frozenset(settled))


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
        tags=tuple(row.tags or ()),
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
        with translated("insert"), self.engine.begin() as conn:
            conn.execute(sa.insert(t), list(rows))

    def claim(
        self, *, token: str, now: datetime, grace: timedelta, lease: timedelta, limit: int
    ) -> list[ClaimedRow]:
        """Claim up to ``limit`` due rows (``claim_statement``), in outbox id order."""
        stmt = claim_statement(
            token=token,
            now=now,
            grace=grace,
            lease=lease,
            limit=limit,
            dialect=self.engine.dialect.name,
        )
        with _transaction(self.engine, "claim") as conn:
            claimed = [_claimed(row) for row in conn.execute(stmt)]
        return sorted(claimed, key=lambda row: row.id)  # RETURNING has no order; keys need it

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

    def order_check(self, *, message_ids: Sequence[str]) -> OrderCheck:
        """Which of these keyed messages may be sent now, and in which order."""
        with translated("order check"), self.engine.connect() as conn:
            return _order_check(conn, message_ids=message_ids)

    def purge_sent(self, *, before: datetime, batch_size: int) -> int:
        """Delete up to ``batch_size`` rows sent before ``before``; returns how many."""
        old = sa.select(t.c.id).where(t.c.status == "sent", t.c.sent_at < before).limit(batch_size)
        stmt = sa.delete(t).where(t.c.id.in_(old.scalar_subquery()))
        with _transaction(self.engine, "purge") as conn:
            return conn.execute(stmt).rowcount

    def backlog(self) -> list[SubjectBacklog]:
        """Pending and dead rows per subject, in one aggregate over those two statuses
        (sent rows, the bulk of the table, are not read): the compensator's gauges."""
        pending = t.c.status == "pending"
        stmt = (
            sa.select(
                t.c.subject,
                sa.func.count().filter(pending),
                sa.func.min(t.c.created_at).filter(pending),
                sa.func.count().filter(t.c.status == "dead"),
            )
            .where(t.c.status.in_(("pending", "dead")))
            .group_by(t.c.subject)
            .order_by(t.c.subject)
        )
        with translated("backlog"), self.engine.connect() as conn:
            rows = conn.execute(stmt).all()
        return [
            SubjectBacklog(
                subject=subject,
                pending=int(count),
                oldest_pending_at=as_utc(oldest),
                dead=int(dead),
            )
            for subject, count, oldest, dead in rows
        ]

    def not_due(self, *, now: datetime, grace: timedelta) -> NotDue:
        """The pending rows a claim at ``now`` with ``grace`` would pass over."""
        young = sa.and_(t.c.attempts == 0, t.c.created_at > now - grace)
        retry = sa.and_(sa.not_(young), t.c.next_attempt_at > now)
        stmt = sa.select(
            sa.func.count().filter(young),
            sa.func.min(t.c.created_at).filter(young),
            sa.func.count().filter(retry),
            sa.func.min(t.c.next_attempt_at).filter(retry),
        ).where(t.c.status == "pending")
        with translated("not due"), self.engine.connect() as conn:
            in_grace, oldest, retrying, next_retry = conn.execute(stmt).one()
        first = as_utc(oldest)
        dues = [d for d in (first + grace if first else None, as_utc(next_retry)) if d]
        return NotDue(
            in_grace=int(in_grace), retrying=int(retrying), next_due_at=min(dues, default=None)
        )


class AsyncOutboxStore:
    """The dispatcher's order checks and completions for asyncio apps, on an ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def mark_dispatched(
        self, *, sent_ids: Sequence[str], dead: Sequence[tuple[str, str]], now: datetime
    ) -> int:
        """``OutboxStore.mark_dispatched``, the same statements through ``run_sync``."""
        if not sent_ids and not dead:
            return 0
        with translated("mark dispatched"):
            async with self.engine.begin() as conn:
                await conn.run_sync(_no_flush_wait)
                return await conn.run_sync(_mark_dispatched, sent_ids=sent_ids, dead=dead, now=now)

    async def order_check(self, *, message_ids: Sequence[str]) -> OrderCheck:
        """``OutboxStore.order_check`` through ``run_sync``."""
        with translated("order check"):
            async with self.engine.connect() as conn:
                return await conn.run_sync(_order_check, message_ids=message_ids)


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
