"""An outbox row's values and the INSERT that writes a transaction's rows.

``Outbox.publish`` stages each message with its row's values (``row_values``); the outbox's
writer puts a session's staged rows in with one ``insert_rows`` on the session's connection,
at its next flush or right before COMMIT (``qmq_outbox.tracking``). No ORM object is made:
the unit of work has nothing of them to do.

Per-key order needs a key's outbox ids to follow its transactions' commits: otherwise a
transaction holding id 5 of key k could commit after the one holding id 6 was already sent.
So on PostgreSQL, right before a keyed row's INSERT, its writer takes a transaction-level
advisory lock on its (subject, key) (``key_lock_id``): transactions publishing the same key
queue there until the first one ends, and each takes its ids after the previous committed.
SQLite needs nothing: one writer at a time already does that. Unkeyed rows take no lock.

On PostgreSQL through psycopg (sync), the INSERT goes straight to the driver's connection,
its SQL compiled once by SQLAlchemy for the dialect with positional parameters (psycopg
maps named ones anew on every call): the same statement in the same transaction (prepared by
psycopg as any repeated query, per its ``prepare_threshold``), at about half the client CPU
of a Core execution.
SQLAlchemy's statement events do not see it; with a ``schema_translate_map`` or any other
driver the Core INSERT runs.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect

from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.schema import outbox_table


def row_values(message: OutgoingMessage, content_type: str) -> dict[str, Any]:
    """A pending row for ``message``; due immediately (the compensator adds its grace)."""
    assert message.created_at is not None
    return {
        "message_id": message.id,
        "subject": message.subject,
        "key": message.key,
        "headers": message.headers,
        "body": message.body,
        "content_type": content_type,
        "producer": message.producer,
        "deliver_at": message.deliver_at,
        "tags": list(message.tags) if message.tags else None,
        "status": "pending",
        "attempts": 0,
        "next_attempt_at": message.created_at,
        "created_at": message.created_at,
    }


# No RETURNING: nothing reads the ids back.
_INSERT = sa.insert(outbox_table).inline()


# JSON columns go to the driver as JSON text (None as JSON null, as SQLAlchemy's JSON type
# writes it); the SQL is compiled once per dialect and set of columns, with the order its
# positional parameters go in.
_JSON_COLUMNS = frozenset(c.name for c in outbox_table.c if isinstance(c.type, sa.JSON))
_PREPARED: weakref.WeakKeyDictionary[Dialect, dict[tuple[str, ...], tuple[str, list[str]]]] = (
    weakref.WeakKeyDictionary()
)


def insert_rows(connection: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    """INSERT ``rows`` (``row_values``) on ``connection``, in order, in one statement; each
    keyed row's lock is taken first."""
    for values in rows:
        if values["key"] is not None:
            lock_key(connection, values["subject"], values["key"])
    prepared = _prepared_sql(connection, tuple(rows[0]))
    if prepared is None:
        connection.execute(_INSERT, list(rows))
        return
    sql, order = prepared
    driver = connection.connection.driver_connection
    params = [
        tuple(orjson.dumps(values[k]).decode() if k in _JSON_COLUMNS else values[k] for k in order)
        for values in rows
    ]
    error = connection.dialect.loaded_dbapi.Error
    try:
        if len(params) == 1:
            driver.execute(sql, params[0])  # type: ignore[union-attr]
        else:
            with driver.cursor() as cursor:  # type: ignore[union-attr]
                cursor.executemany(sql, params)
    except error as exc:  # raised as SQLAlchemy would: IntegrityError for a repeated id, ...
        raise sa.exc.DBAPIError.instance(
            sql, params, exc, error, dialect=connection.dialect
        ) from exc


def _prepared_sql(connection: Connection, columns: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """The INSERT's SQL for psycopg's own connection and the columns its parameters go
    by, or None where Core must run it."""
    dialect = connection.dialect
    if dialect.driver != "psycopg" or dialect.is_async:
        return None
    if connection.get_execution_options().get("schema_translate_map"):
        return None
    compiled = _PREPARED.setdefault(dialect, {})
    prepared = compiled.get(columns)
    if prepared is None:
        same_kind: Callable[..., Dialect] = type(dialect)
        positional = same_kind(paramstyle="format")  # ``%s`` placeholders
        statement = _INSERT.compile(dialect=positional, column_keys=columns)
        prepared = compiled[columns] = (str(statement), list(statement.positiontup or ()))
    return prepared


def key_lock_id(subject: str, key: str) -> int:
    """The advisory lock id of (subject, key): 64 bits of BLAKE2b, the same in every process."""
    digest = hashlib.blake2b(f"qmq-outbox\0{subject}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


_LOCKS_TAKEN = "qmq_outbox.key_locks"


def lock_key(connection: Connection, subject: str, key: str) -> None:
    """Take (subject, key)'s lock (PostgreSQL only), once per (sub)transaction: a rolled-back
    savepoint gives back the locks it took."""
    if connection.dialect.name != "postgresql":
        return
    lock_id = key_lock_id(subject, key)
    transaction = connection.get_nested_transaction() or connection.get_transaction()
    owner, taken = connection.info.get(_LOCKS_TAKEN, (None, set()))
    if owner is not transaction:
        taken = set()
        connection.info[_LOCKS_TAKEN] = (transaction, taken)
    if lock_id not in taken:
        connection.execute(sa.select(sa.func.pg_advisory_xact_lock(lock_id)))
        taken.add(lock_id)
