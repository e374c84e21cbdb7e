"""pgqueuer on asyncpg, as its README leads: the service enqueues with ``Queries.enqueue``
on its transaction's asyncpg connection (a SQLAlchemy ``AsyncSession`` on asyncpg here);
the worker is ``PgQueuer`` over an asyncpg connection with one entrypoint, run with
``PgQueuer.run()``'s defaults under uvloop (what ``pgq run`` does). The entrypoint writes
the effect through an asyncpg pool of the worker's; pgqueuer then logs the job done on its
own connection (the effect and the ack are separate transactions)."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import uvloop
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from bench._flow.common import (
    EFFECT_SQL_ASYNCPG,
    INSERT_ORDER,
    RolledBack,
    System,
    libpq_dsn,
    nothing_else,
    with_driver,
)

ENTRYPOINT = "flow_effect"
EFFECT_POOL = 10


def install(db_url: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(libpq_dsn(db_url))
        try:
            await Queries(AsyncpgDriver(conn)).install()
        finally:
            await conn.close()

    asyncio.run(run())


class PgqService:
    def __init__(self, db_url: str, connections: int) -> None:
        self._connections = connections
        self._engine = create_async_engine(
            with_driver(db_url, "postgresql+asyncpg"), pool_size=connections
        )
        self._maker = async_sessionmaker(self._engine)
        self._queries: dict[int, Queries] = {}  # by asyncpg connection: one driver each

    async def warm(self) -> None:
        opened = [await self._engine.connect() for _ in range(self._connections)]
        for conn in opened:
            await conn.close()

    async def transaction(self, order_id: int, *, rollback: bool) -> None:
        async with self._maker.begin() as session:
            await session.execute(INSERT_ORDER, {"id": order_id, "amount": 1})
            raw = (await (await session.connection()).get_raw_connection()).driver_connection
            queries = self._queries.get(id(raw))
            if queries is None:
                queries = self._queries[id(raw)] = Queries(AsyncpgDriver(raw))
            await queries.enqueue(ENTRYPOINT, str(order_id).encode())
            if rollback:
                raise RolledBack

    async def close(self) -> None:
        await self._engine.dispose()


def worker(db_url: str, config: dict[str, str], ready: Any) -> None:
    uvloop.run(_work(libpq_dsn(db_url), ready))


async def _work(dsn: str, ready: Any) -> None:
    connection = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=EFFECT_POOL, max_size=EFFECT_POOL)
    pgq = PgQueuer.from_asyncpg_connection(connection)

    @pgq.entrypoint(ENTRYPOINT, accepts_context=False)
    async def effect(job: Job) -> None:
        started = time.time()
        assert job.payload is not None
        await pool.execute(EFFECT_SQL_ASYNCPG, int(job.payload), started)

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, pgq.shutdown.set)
    ready.set()
    try:
        await pgq.run()
    finally:
        await pool.close()
        await connection.close()


SYSTEM = System(
    name="pgqueuer",
    title="pgqueuer",
    install=install,
    deploy=nothing_else,
    service=lambda db_url, config, n: PgqService(db_url, n),
    worker=worker,
    note="pgqueuer: `async with AsyncSession.begin()` (SQLAlchemy on asyncpg): business row +"
    " `Queries(AsyncpgDriver(<the transaction's asyncpg connection>)).enqueue(...)`; worker"
    " `PgQueuer.from_asyncpg_connection(...)`, one entrypoint, `run()` defaults (batch 10,"
    f" no concurrency cap) under uvloop; the effect through an asyncpg pool of {EFFECT_POOL}"
    " connections, committed on its own, before pgqueuer logs the job done",
)
