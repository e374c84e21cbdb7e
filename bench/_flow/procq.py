"""procrastinate on psycopg: the service defers with ``task.configure(connection=...)``, the
external-connection form its docs give for deferring inside the caller's transaction (here
the psycopg connection under a SQLAlchemy ``Session``); the worker is
``App.run_worker_async(concurrency=8)`` (its concurrency how-to, for async tasks), other
options default (LISTEN/NOTIFY on). The task writes the effect through a psycopg pool of the
worker's; procrastinate then marks the job done on its own connection."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import sqlalchemy as sa
from procrastinate import App, PsycopgConnector
from procrastinate.tasks import Task
from psycopg_pool import AsyncConnectionPool
from sqlalchemy.orm import sessionmaker

from bench._flow.common import (
    EFFECT_SQL_PSYCOPG,
    INSERT_ORDER,
    RolledBack,
    System,
    libpq_dsn,
    nothing_else,
    warm,
)

TASK = "flow_effect"
CONCURRENCY = 8


def _app(dsn: str, effect_pool: AsyncConnectionPool | None) -> tuple[App, Task[Any, Any, Any]]:
    app = App(connector=PsycopgConnector(conninfo=dsn))

    @app.task(name=TASK)
    async def effect(order: int) -> None:
        started = time.time()
        assert effect_pool is not None, "the task runs in the worker only"
        async with effect_pool.connection() as conn:
            await conn.execute(EFFECT_SQL_PSYCOPG, (order, started))

    return app, effect


def install(db_url: str) -> None:
    app, _ = _app(libpq_dsn(db_url), None)
    with app.open():
        app.schema_manager.apply_schema()


class ProcrastinateService:
    def __init__(self, db_url: str, connections: int) -> None:
        self._engine = sa.create_engine(db_url, pool_size=connections)
        self._maker = sessionmaker(self._engine)
        self._app, self._task = _app(libpq_dsn(db_url), None)
        self._app.open()
        warm(self._engine, connections)

    def transaction(self, order_id: int, *, rollback: bool) -> None:
        with self._maker.begin() as session:
            session.execute(INSERT_ORDER, {"id": order_id, "amount": 1})
            raw = session.connection().connection.driver_connection
            self._task.configure(connection=raw).defer(order=order_id)
            if rollback:
                raise RolledBack

    def close(self) -> None:
        self._app.close()
        self._engine.dispose()


def worker(db_url: str, config: dict[str, str], ready: Any) -> None:
    asyncio.run(_work(libpq_dsn(db_url), ready))


async def _work(dsn: str, ready: Any) -> None:
    async with AsyncConnectionPool(dsn, min_size=CONCURRENCY, open=False) as pool:
        app, _ = _app(dsn, pool)
        async with app.open_async():
            ready.set()
            await app.run_worker_async(concurrency=CONCURRENCY)  # SIGTERM stops it


SYSTEM = System(
    name="procrastinate",
    title="procrastinate",
    install=install,
    deploy=nothing_else,
    service=lambda db_url, config, n: ProcrastinateService(db_url, n),
    worker=worker,
    note="procrastinate: `with Session.begin()` (SQLAlchemy, psycopg): business row +"
    " `task.configure(connection=<the session's psycopg connection>).defer(...)`; worker"
    f" `App(connector=PsycopgConnector(...)).run_worker_async(concurrency={CONCURRENCY})`,"
    " other options default; the effect through a psycopg pool, committed on its own,"
    " before procrastinate marks the job done",
)
