"""What every system's flow shares: the business and effect tables, the fresh database,
the exactly-once check and the PostgreSQL processes whose CPU a run counts."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

import psutil
import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench import _database as database

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
ROLLBACK_EVERY = 20  # transaction i rolls back when i % 20 == 19

business = sa.MetaData()
orders = sa.Table(
    "flow_orders",
    business,
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
)
# No unique constraint on purpose: a second effect for one order must show, not fail.
effects = sa.Table(
    "flow_effects",
    business,
    sa.Column("order_id", sa.BigInteger, nullable=False),
    sa.Column("started_at", sa.Double, nullable=False),  # wall clock at handler entry
    sa.Column(
        "written_at", sa.DateTime(timezone=True), server_default=sa.text("clock_timestamp()")
    ),
)
INSERT_ORDER = sa.insert(orders)
INSERT_EFFECT = sa.insert(effects)
EFFECT_SQL_PSYCOPG = "INSERT INTO flow_effects (order_id, started_at) VALUES (%s, %s)"
EFFECT_SQL_ASYNCPG = "INSERT INTO flow_effects (order_id, started_at) VALUES ($1, $2)"


class RolledBack(Exception):
    """Raised inside a transaction the producer means to roll back."""


def rolls_back(order_id: int) -> bool:
    return order_id % ROLLBACK_EVERY == ROLLBACK_EVERY - 1


class SyncService(Protocol):
    """The producing service of one system: ``transaction`` commits one business row and
    enqueues one message in the same transaction (or raises ``RolledBack`` after both)."""

    def transaction(self, order_id: int, *, rollback: bool) -> None: ...

    def close(self) -> None: ...


class AsyncService(Protocol):
    async def warm(self) -> None:
        """Open the connections before the measured stretch."""

    async def transaction(self, order_id: int, *, rollback: bool) -> None: ...

    async def close(self) -> None: ...


def libpq_dsn(url: str) -> str:
    """``postgresql://...`` for a driver used without SQLAlchemy."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def with_driver(url: str, driver: str) -> str:
    return make_url(url).set(drivername=driver).render_as_string(hide_password=False)


def fresh_database(admin_url: str) -> AbstractContextManager[str]:
    """A new database with the business tables; dropped on exit."""
    return database.fresh_database(admin_url, prefix="qmq_bench_flow", tables=(business,))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Produced:
    """What the producer processes report: commit wall clock by order id, rolled back ids."""

    committed: dict[int, float]
    rolled_back: list[int]
    late: int  # paced runs: transactions that started more than 5 ms after their slot
    finished: float  # monotonic clock when the last transaction had ended
    caller_cpu: float  # CPU seconds of the threads that ran the transactions (NaN: async)


class ExactlyOnceError(AssertionError):
    """The effects table does not hold exactly one effect per committed transaction."""


class Database:
    """The bench's own connection to the run's database: counts, the check, the pids."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(libpq_dsn(url), autocommit=True)
        self.name = make_url(url).database

    def close(self) -> None:
        self.conn.close()

    def count(self, table: str) -> int:
        row = self.conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        return int(row[0]) if row else 0

    def started(self) -> dict[int, float]:
        rows = self.conn.execute("SELECT order_id, started_at FROM flow_effects").fetchall()
        return {int(order): float(at) for order, at in rows}

    def check_exactly_once(self, produced: Produced) -> None:
        """One effect per committed order, none for a rolled-back one; raise otherwise."""
        effect_ids = [int(r[0]) for r in self.conn.execute("SELECT order_id FROM flow_effects")]
        order_ids = {int(r[0]) for r in self.conn.execute("SELECT id FROM flow_orders")}
        committed = set(produced.committed)
        problems: list[str] = []
        if order_ids != committed:
            problems.append(
                f"business rows {len(order_ids)} != committed transactions {len(committed)}"
            )
        seen = set(effect_ids)
        twice = {order for order, n in collections.Counter(effect_ids).items() if n > 1}
        if twice:
            problems.append(f"{len(twice)} orders have more than one effect, e.g. {min(twice)}")
        missing = committed - seen
        if missing:
            problems.append(f"{len(missing)} committed orders have no effect, e.g. {min(missing)}")
        ghosts = seen & set(produced.rolled_back)
        if ghosts:
            problems.append(f"{len(ghosts)} rolled-back orders have an effect, e.g. {min(ghosts)}")
        strays = seen - committed - ghosts
        if strays:
            problems.append(f"{len(strays)} effects of unknown orders, e.g. {min(strays)}")
        if problems:
            raise ExactlyOnceError("; ".join(problems))

    def backend_pids(self) -> tuple[list[int], list[int]]:
        """(this database's backends but the bench's own connection, the server's shared
        background processes: WAL writer, checkpointer, background writer)."""
        rows = self.conn.execute(
            "SELECT pid, datname, backend_type FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        ).fetchall()
        shared = ("walwriter", "checkpointer", "background writer")
        ours = [pid for pid, datname, _ in rows if datname == self.name]
        aux = [pid for pid, datname, kind in rows if datname is None and kind in shared]
        return ours, aux


def processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


def with_children(process: psutil.Process | None) -> list[psutil.Process]:
    if process is None:
        return []
    try:
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def warm(engine: sa.Engine, connections: int) -> None:
    """Open the pool's connections before the measured stretch."""
    opened = [engine.connect() for _ in range(connections)]
    for conn in opened:
        conn.close()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    """What a system runs besides the producers and the worker: ``config`` goes to both
    (e.g. the broker's URL); ``roles`` names the processes whose CPU counts per message."""

    config: dict[str, str]
    roles: dict[str, Callable[[], list[psutil.Process]]]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class System:
    """One system under test, as its docs say to deploy it.

    ``install``: its schema in the fresh database; ``deploy``: its other processes for the
    run; ``service``: the producing service in a producer process (given the database URL,
    the deployment's config and how many connections it runs at once); ``worker``: the
    worker process's body (database URL, config, an event to set once it runs), or None
    for the tax's baseline, which has no worker."""

    name: str
    title: str
    install: Callable[[str], None]
    deploy: Callable[[str, Path], AbstractContextManager[Deployment]]
    service: Callable[[str, dict[str, str], int], SyncService | AsyncService]
    worker: Callable[[str, dict[str, str], Any], None] | None
    note: str


@contextmanager
def nothing_else(db_url: str, workdir: Path) -> Iterator[Deployment]:
    yield Deployment(config={}, roles={})
