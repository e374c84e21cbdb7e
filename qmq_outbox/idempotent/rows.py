"""Statements on ``qmq_consumed`` and the mapping of its unique violation to ``Duplicate``.

The adapter layer of the idempotent store: every SQL statement the store runs is built
here, the same for PostgreSQL and SQLite, sync and async. Times are computed by the caller
(in UTC) and passed in, so both databases compare them the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from qmq_outbox.envelope import Message
from qmq_outbox.schema import consumed_table as t

PK_NAME = "pk_qmq_consumed"
PROCESSING = "processing"
DONE = "done"


# Statements are built once with bind parameters and executed with a parameter dict: no
# per-message construction or cache-key generation (it is most of the store's CPU cost).
_INSERT = sa.insert(t)
_KEY = sa.and_(
    t.c.consumer_group == sa.bindparam("g_group"), t.c.message_id == sa.bindparam("g_id")
)
_TAKE_OVER = (
    sa.update(t)
    .where(_KEY, t.c.status == PROCESSING, t.c.lease_until <= sa.bindparam("g_now"))
    .values(lease_until=sa.bindparam("g_until"), consumed_at=sa.bindparam("g_now"))
)
_SELECT_STATE = sa.select(t.c.status, t.c.lease_until).where(_KEY)
_MARK_DONE = (
    sa.update(t)
    .where(_KEY)
    .values(status=DONE, lease_until=None, consumed_at=sa.bindparam("g_now"))
)
_RELEASE = sa.delete(t).where(
    _KEY, t.c.status == PROCESSING, t.c.lease_until == sa.bindparam("g_until")
)

Statement = tuple[sa.Executable, Any]  # a statement and its parameters (a dict or a list)


def _row(group: str, message_id: str, now: datetime, until: datetime | None) -> dict[str, Any]:
    """A *done* row, or a *processing* one leased ``until``."""
    return {
        "consumer_group": group,
        "message_id": message_id,
        "status": DONE if until is None else PROCESSING,
        "lease_until": until,
        "consumed_at": now,
    }


def insert_done(group: str, message_id: str, *, now: datetime) -> Statement:
    """The transactional mode's dedup row, committed with the handler's writes."""
    return _INSERT, _row(group, message_id, now, None)


def insert_processing(group: str, message_id: str, *, now: datetime, until: datetime) -> Statement:
    """The non-transactional mode's claim: a *processing* row with a lease."""
    return _INSERT, _row(group, message_id, now, until)


def take_over_expired(group: str, message_id: str, *, now: datetime, until: datetime) -> Statement:
    """Claim a *processing* row whose holder's lease ran out (it crashed or hung)."""
    return _TAKE_OVER, {"g_group": group, "g_id": message_id, "g_now": now, "g_until": until}


def select_state(group: str, message_id: str) -> Statement:
    """``(status, lease_until)`` of a row."""
    return _SELECT_STATE, {"g_group": group, "g_id": message_id}


def mark_done(group: str, message_id: str, *, now: datetime) -> Statement:
    """Record that the outside effect happened (unfenced: whoever finishes first records it)."""
    return _MARK_DONE, {"g_group": group, "g_id": message_id, "g_now": now}


def release(group: str, message_id: str, *, until: datetime) -> Statement:
    """Drop our own claim after a failed handler, fenced by our lease so a twin's survives."""
    return _RELEASE, {"g_group": group, "g_id": message_id, "g_until": until}


def insert_done_many(
    dialect: str, group: str, messages: Sequence[Message], *, now: datetime
) -> Statement | None:
    """The dedup rows of a batch at once, skipping existing ones, returning the inserted ids.

    Rows go in ordered by message id, so two batches sharing messages lock them in the same
    order (no deadlock). None where the dialect has no ``ON CONFLICT DO NOTHING``.
    """
    ids = sorted({message.id for message in messages})
    if dialect == "postgresql":
        return _insert_done_many_pg(), {"g_group": group, "g_ids": ids, "g_now": now}
    if dialect == "sqlite":
        return _insert_done_many_sqlite(), [
            _row(group, message_id, now, None) for message_id in ids
        ]
    return None


@functools.cache
def _insert_done_many_pg() -> sa.Executable:
    """One statement of constant text whatever the batch's size, its ids one array parameter:
    the driver parses it once and can prepare it (a row of placeholders per message would be
    a new text for every batch size, parsed again each time)."""
    from sqlalchemy.dialects import postgresql

    ids = sa.func.unnest(
        sa.bindparam("g_ids", type_=postgresql.ARRAY(t.c.message_id.type))
    ).column_valued("message_id")
    rows = sa.select(
        sa.bindparam("g_group", type_=t.c.consumer_group.type),
        ids,
        sa.literal(DONE, t.c.status.type),
        sa.bindparam("g_now", type_=t.c.consumed_at.type),
    ).order_by(ids)
    columns = [t.c.consumer_group, t.c.message_id, t.c.status, t.c.consumed_at]
    insert = postgresql.insert(t).from_select(columns, rows)
    return insert.on_conflict_do_nothing().returning(t.c.message_id)


@functools.cache
def _insert_done_many_sqlite() -> sa.Executable:
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(t).on_conflict_do_nothing().returning(t.c.message_id)


def gc_batch(*, cutoff: datetime, limit: int) -> sa.Delete:
    """Delete up to ``limit`` rows older than ``cutoff``: done ones, and abandoned claims."""
    old = (
        sa.select(t.c.consumer_group, t.c.message_id)
        .where(t.c.consumed_at < cutoff, sa.or_(t.c.status == DONE, t.c.lease_until < cutoff))
        .limit(limit)
    )
    return sa.delete(t).where(sa.tuple_(t.c.consumer_group, t.c.message_id).in_(old))


def as_utc(value: datetime) -> datetime:
    """SQLite hands timestamps back naive; they were written in UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RowState:
    """What a claim attempt found when the row already existed."""

    status: str
    lease_until: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> RowState:
        until = row.lease_until
        return cls(status=row.status, lease_until=as_utc(until) if until is not None else None)


def _constraint_name(exc: BaseException | None) -> str | None:
    """psycopg: ``diag.constraint_name``; asyncpg: ``constraint_name`` on the cause."""
    seen = 0
    while exc is not None and seen < 4:
        diag = getattr(exc, "diag", None)
        name = getattr(diag, "constraint_name", None) or getattr(exc, "constraint_name", None)
        if isinstance(name, str):
            return name
        exc = exc.__cause__
        seen += 1
    return None


def is_duplicate(exc: IntegrityError) -> bool:
    """Whether an IntegrityError raised by one of *our* inserts is the dedup key's violation.

    Drivers that name the violated constraint must name ``pk_qmq_consumed``; SQLite does not
    name it, and our insert can violate nothing else, so it counts when it cites the table.
    """
    name = _constraint_name(exc.orig)
    if name is not None:
        return name == PK_NAME
    text = str(exc.orig)
    return PK_NAME in text or ("UNIQUE" in text.upper() and t.name in text)
