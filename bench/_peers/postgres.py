"""A PostgreSQL table queue, as a SQLAlchemy team would build one instead of a broker.

Produce: one ``INSERT`` of a whole batch per transaction. Consume: ``DELETE ... FOR UPDATE
SKIP LOCKED ... RETURNING`` in a transaction that commits after the handler (the ack).
An empty poll sleeps ``POLL_INTERVAL`` before the next one. ``synchronous_commit`` is on.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import cast

import psutil
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench._peers.common import version_of

POLL_INTERVAL = 0.005  # s between polls of an empty table
TABLE = "queue"
_INSERT = f"INSERT INTO {TABLE} (body) SELECT unnest(%b::bytea[])"
_TAKE = f"""
    DELETE FROM {TABLE} WHERE id IN (
        SELECT id FROM {TABLE} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED
    ) RETURNING body
"""
_CREATE = f"""
    CREATE TABLE {TABLE} (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        body bytea NOT NULL
    )
"""
_SETTINGS = ("server_version", "fsync", "synchronous_commit", "wal_sync_method")


async def _connect(url: str, *, autocommit: bool) -> psycopg.AsyncConnection[tuple[object, ...]]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=autocommit)
    await conn.execute("SET synchronous_commit = on")
    if not autocommit:
        await conn.commit()
    return conn


class PostgresProducer:
    def __init__(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        self._conn = conn  # autocommit: each INSERT is its own transaction

    async def send(self, bodies: Sequence[bytes]) -> None:
        await self._conn.execute(_INSERT, [list(bodies)])


class PostgresConsumer:
    def __init__(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        self._conn = conn  # not autocommit: the DELETE's transaction stays open until ack()

    async def take(self, max_messages: int, wait: float) -> list[bytes]:
        give_up = time.perf_counter() + wait
        while True:
            cursor = await self._conn.execute(_TAKE, [max_messages])
            rows = await cursor.fetchall()
            if rows:
                return [cast(bytes, row[0]) for row in rows]  # bytea loads as bytes
            await self._conn.rollback()
            if time.perf_counter() >= give_up:
                return []
            await asyncio.sleep(POLL_INTERVAL)

    async def ack(self) -> None:
        await self._conn.commit()

    async def flush(self) -> None:
        pass  # acks are sent at once


class PostgresPeer:
    """A database of its own (created by ``start``, dropped by ``stop``) with one table."""

    name = "postgres"
    title = "PostgreSQL table"

    def __init__(self, *, admin_url: str) -> None:
        self._admin_url = admin_url
        self._database = f"qmq_peers_{os.getpid()}"
        self._url = make_conninfo(admin_url, dbname=self._database)
        self._settings: dict[str, str] = {}

    async def start(self) -> None:
        async with await psycopg.AsyncConnection.connect(self._admin_url, autocommit=True) as admin:
            await admin.execute(
                sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self._database))
            )
        async with await psycopg.AsyncConnection.connect(self._url, autocommit=True) as conn:
            await conn.execute(_CREATE)
            for setting in _SETTINGS:
                cursor = await conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting)))
                row = await cursor.fetchone()
                self._settings[setting] = str(row[0]) if row else "?"

    async def stop(self) -> None:
        async with await psycopg.AsyncConnection.connect(self._admin_url, autocommit=True) as admin:
            drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
            await admin.execute(drop.format(sql.Identifier(self._database)))

    async def reset(self) -> None:
        async with await psycopg.AsyncConnection.connect(self._url, autocommit=True) as conn:
            await conn.execute(f"TRUNCATE {TABLE}")

    @asynccontextmanager
    async def producer(self) -> AsyncIterator[PostgresProducer]:
        async with await _connect(self._url, autocommit=True) as conn:
            yield PostgresProducer(conn)

    @asynccontextmanager
    async def consumer(self, *, prefetch: int, streaming: bool) -> AsyncIterator[PostgresConsumer]:
        async with await _connect(self._url, autocommit=False) as conn:
            yield PostgresConsumer(conn)

    def server_processes(self) -> list[psutil.Process]:
        """The postmaster, its auxiliary processes (WAL writer, checkpointer, ...) and the
        backends of this database; other databases' backends are left out."""
        chosen = []
        for process in psutil.process_iter(["name", "cmdline"]):
            if process.info["name"] != "postgres":
                continue
            title = " ".join(process.info["cmdline"] or ())
            is_backend = "(" in title or "[local]" in title
            if not is_backend or f" {self._database} " in f"{title} ":
                chosen.append(process)
        return chosen

    def notes(self) -> list[str]:
        s = self._settings
        host = conninfo_to_dict(self._url).get("host", "?")
        return [
            f"PostgreSQL {s.get('server_version', '?')} on {host} (psycopg {version_of('psycopg')},"
            f" async): fsync {s.get('fsync')}, synchronous_commit"
            f" {s.get('synchronous_commit')}, wal_sync_method {s.get('wal_sync_method')};"
            " a batch is one `INSERT ... SELECT unnest(...)` per transaction; a pull is"
            " `DELETE ... WHERE id IN (SELECT id ... ORDER BY id LIMIT 100 FOR UPDATE SKIP"
            " LOCKED) RETURNING body`, its ack the `COMMIT` after the handler; an empty poll"
            f" sleeps {POLL_INTERVAL * 1000:g} ms"
        ]
