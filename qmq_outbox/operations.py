"""The SQL behind ``qmq outbox``: what the table holds per app and subject, its dead rows,
and bringing dead rows back (docs/outbox.md, "Operating the outbox").

Each call runs in its own short transaction on the caller's engine. SQLAlchemy errors
become ``OutboxStoreError`` here. Purging sent rows is ``OutboxStore.purge_sent``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qmq_outbox.schema import outbox_table as t
from qmq_outbox.store import as_utc, ids_match, translated


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StatusRow:
    """One (app, subject)'s rows by status; ``app`` is the rows' producer (None: unnamed)."""

    app: str | None
    subject: str
    pending: int
    oldest_pending_at: datetime | None
    sent: int
    dead: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeadRow:
    """A dead row: why it was given up on (``reason``, the row's ``last_error``) and after
    how many attempts."""

    id: int
    message_id: str
    app: str | None
    subject: str
    key: str | None
    attempts: int
    created_at: datetime
    reason: str | None


def status(engine: Engine) -> list[StatusRow]:
    """Every (app, subject) with rows, by app then subject (one scan of the table)."""
    pending = t.c.status == "pending"
    stmt = (
        sa.select(
            t.c.producer,
            t.c.subject,
            sa.func.count().filter(pending),
            sa.func.min(t.c.created_at).filter(pending),
            sa.func.count().filter(t.c.status == "sent"),
            sa.func.count().filter(t.c.status == "dead"),
        )
        .group_by(t.c.producer, t.c.subject)
        .order_by(t.c.producer, t.c.subject)
    )
    with translated("status"), engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return [
        StatusRow(
            app=app,
            subject=subject,
            pending=int(count),
            oldest_pending_at=as_utc(oldest),
            sent=int(sent),
            dead=int(dead),
        )
        for app, subject, count, oldest, sent, dead in rows
    ]


def dead_rows(engine: Engine, *, subjects: Sequence[str] = (), limit: int) -> list[DeadRow]:
    """Up to ``limit`` dead rows (of ``subjects``, when given), oldest id first."""
    stmt = (
        sa.select(
            t.c.id,
            t.c.message_id,
            t.c.producer,
            t.c.subject,
            t.c.key,
            t.c.attempts,
            t.c.created_at,
            t.c.last_error,
        )
        .where(t.c.status == "dead")
        .order_by(t.c.id)
        .limit(limit)
    )
    if subjects:
        stmt = stmt.where(t.c.subject.in_(list(subjects)))
    with translated("dead rows"), engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return [
        DeadRow(
            id=row.id,
            message_id=row.message_id,
            app=row.producer,
            subject=row.subject,
            key=row.key,
            attempts=row.attempts,
            created_at=as_utc(row.created_at) or row.created_at,
            reason=row.last_error,
        )
        for row in rows
    ]


def retry_dead(
    engine: Engine,
    *,
    now: datetime,
    ids: Sequence[int] = (),
    subjects: Sequence[str] = (),
    every: bool = False,
) -> list[int]:
    """Make dead rows pending again, due at ``now`` with a fresh count of attempts: those
    of ``ids``, of ``subjects``, or ``every`` one. Returns the ids made pending.

    Safe beside running compensators: a claim only takes pending rows, and the row lock of
    this update orders the two. The claim token is cleared, so no earlier claimant of the
    row (whose send ended in its death) can complete it: only the next claim can.
    """
    if not (ids or subjects or every):
        return []
    stmt = (
        sa.update(t)
        .where(t.c.status == "dead")
        .values(
            status="pending",
            attempts=0,
            next_attempt_at=now,
            claim_token=None,
            claimed_until=None,
        )
        .returning(t.c.id)
    )
    if ids:
        stmt = stmt.where(ids_match(ids, engine.dialect.name))
    if subjects:
        stmt = stmt.where(t.c.subject.in_(list(subjects)))
    with translated("retry"), engine.begin() as conn:
        return sorted(row.id for row in conn.execute(stmt))
