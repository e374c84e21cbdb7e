"""A hand-written PostgreSQL table queue: the service INSERTs a job row and NOTIFYs in its
transaction; the worker takes up to ``BATCH`` jobs with ``DELETE ... FOR UPDATE SKIP LOCKED
... RETURNING`` and writes their effects in the same transaction (so the effect and the ack
commit together), and sleeps on LISTEN when the table is empty."""

from __future__ import annotations

import signal
import time
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench._flow.common import EFFECT_SQL_PSYCOPG, System, libpq_dsn, nothing_else
from bench._flow.plain import PlainService

CHANNEL = "flow_jobs"
BATCH = 32
IDLE_WAIT = 1.0  # s a LISTEN waits before the worker looks at the table (and at SIGTERM)
_CREATE = """
    CREATE TABLE flow_jobs (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        order_id bigint NOT NULL
    )
"""
_ENQUEUE = sa.text("INSERT INTO flow_jobs (order_id) VALUES (:order_id)")
_NOTIFY = sa.text(f"SELECT pg_notify('{CHANNEL}', '')")
_TAKE = """
    DELETE FROM flow_jobs WHERE id IN (
        SELECT id FROM flow_jobs ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED
    ) RETURNING order_id
"""


def install(db_url: str) -> None:
    with psycopg.connect(libpq_dsn(db_url), autocommit=True) as conn:
        conn.execute(_CREATE)


class TableService(PlainService):
    def enqueue(self, session: Session, order_id: int) -> None:
        session.execute(_ENQUEUE, {"order_id": order_id})
        session.execute(_NOTIFY)


def worker(db_url: str, config: dict[str, str], ready: Any) -> None:
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    dsn = libpq_dsn(db_url)
    with (
        psycopg.connect(dsn, autocommit=True) as listen,
        psycopg.connect(dsn) as work,
    ):
        listen.execute(f"LISTEN {CHANNEL}")
        ready.set()
        while not stopping:
            with work.transaction():
                orders = [row[0] for row in work.execute(_TAKE, (BATCH,))]
                if orders:
                    started = time.time()
                    with work.cursor() as cursor:
                        cursor.executemany(EFFECT_SQL_PSYCOPG, [(o, started) for o in orders])
            if not orders:
                for _ in listen.notifies(timeout=IDLE_WAIT, stop_after=1):
                    pass


SYSTEM = System(
    name="tablequeue",
    title="table queue",
    install=install,
    deploy=nothing_else,
    service=lambda db_url, config, n: TableService(db_url, n),
    worker=worker,
    note="table queue: `with Session.begin()` (SQLAlchemy, psycopg): business row + `INSERT"
    " INTO flow_jobs` + `pg_notify`; worker (psycopg, one loop): `DELETE ... ORDER BY id"
    f" LIMIT {BATCH} FOR UPDATE SKIP LOCKED RETURNING` and the effects' INSERT in one"
    " transaction, LISTEN when the table is empty",
)
