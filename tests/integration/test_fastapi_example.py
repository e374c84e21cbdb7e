"""``examples/fastapi_app.py`` through FastAPI's ``TestClient``, on PostgreSQL and SQLite,
with a real broker process: the sync endpoint (``Session(engine)`` dependency) and the async
one (``async_sessionmaker(engine)`` dependency).

A placed order leaves its domain row, its outbox row marked ``sent`` and the message in the
broker; a request that fails after publishing (the credit limit) leaves none of the three.
"""

from __future__ import annotations

import dataclasses
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from examples.fastapi_app import ShopOrder, create_app, prepare_database
from qmq_outbox.client import BrokerClient
from qmq_outbox.schema import outbox_table
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import clear_outbox, sqlite_transactions, stored_ids
from tests.support.postgres import fresh_database

with warnings.catch_warnings():
    # starlette 0.52's testclient module names an alias anyio 4.16 deprecated, at import only
    warnings.filterwarnings("ignore", "The anyio.abc.BlockingPortal", DeprecationWarning)
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.timeout(60)
SUBJECT = "order.created"


@dataclasses.dataclass(frozen=True)
class Database:
    name: str
    url: str
    async_url: str


@pytest.fixture(scope="module")
def broker_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(tmp_path_factory.mktemp("fastapi-broker") / "data").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pg_database(pg_admin_url: str) -> Iterator[Database]:
    with fresh_database(pg_admin_url, prefix="qmq_fastapi") as url:
        yield Database("postgresql", url, url)


@pytest.fixture(scope="module")
def sqlite_database(tmp_path_factory: pytest.TempPathFactory) -> Database:
    path: Path = tmp_path_factory.mktemp("fastapi-sqlite") / "shop.db"
    return Database("sqlite", f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}")


@pytest.fixture(params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest) -> Database:
    db: Database = request.getfixturevalue(
        "pg_database" if request.param == "postgresql" else "sqlite_database"
    )
    return db


@pytest.fixture
def check(database: Database) -> Iterator[sa.Engine]:
    """Prepares the database like the app's deploy, empties it, and reads it afterwards."""
    engine = sa.create_engine(database.url)
    prepare_database(engine)
    clear_outbox(engine)
    with engine.begin() as conn:
        conn.execute(sa.delete(ShopOrder))
    yield engine
    engine.dispose()


@pytest.fixture
def http(database: Database, check: sa.Engine, broker_proc: BrokerProcess) -> Iterator[TestClient]:
    """The example app with a sync and an async engine, not started: ``with http:`` runs
    its lifespan, and leaving the block drains its outbox."""
    engine = sa.create_engine(database.url)
    # no pooled async connections: they would outlive the TestClient's event loop
    async_engine = create_async_engine(database.async_url, poolclass=NullPool)
    if database.name == "sqlite":
        sqlite_transactions(engine)
        sqlite_transactions(async_engine.sync_engine)
    app = create_app(
        engine=engine,
        async_engine=async_engine,
        broker_url=broker_proc.url,
        credit_limit=Decimal(1000),
    )
    yield TestClient(app)
    engine.dispose()


@pytest.fixture
def broker_client(broker_proc: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(broker_proc.url) as client:
        yield client


def orders(check: sa.Engine) -> list[tuple[str, Decimal]]:
    with check.connect() as conn:
        rows = conn.execute(sa.select(ShopOrder.customer, ShopOrder.amount).order_by(ShopOrder.id))
        return [(customer, Decimal(amount)) for customer, amount in rows]


def outbox_rows(check: sa.Engine) -> dict[str, tuple[str, bytes]]:
    """message_id -> (status, body) of every outbox row."""
    t = outbox_table
    with check.connect() as conn:
        rows = conn.execute(sa.select(t.c.message_id, t.c.status, t.c.body))
        return {r.message_id: (r.status, bytes(r.body)) for r in rows}


@pytest.mark.parametrize("path", ["/orders", "/async/orders"])
def test_order_row_outbox_row_and_message_commit_together(
    path: str,
    http: TestClient,
    check: sa.Engine,
    broker_client: BrokerClient,
) -> None:
    before = stored_ids(broker_client, SUBJECT)
    customer = f"ada-{uuid.uuid4().hex[:8]}"
    with http:
        response = http.post(path, json={"customer": customer, "amount": "600.00"})
        assert response.status_code == 201, response.text
    # leaving the block ran the app's shutdown: the outbox is drained
    placed = response.json()
    assert orders(check) == [(customer, Decimal("600.00"))]
    ((message_id, (status, body)),) = outbox_rows(check).items()
    assert (message_id, status) == (placed["message_id"], "sent")
    assert orjson.loads(body) == {
        "order_id": placed["order_id"],
        "customer": customer,
        "amount": "600.00",  # a Decimal, as a string: its digits kept
        "created_at": placed["created_at"],
    }
    assert stored_ids(broker_client, SUBJECT) - before == Counter([message_id])


@pytest.mark.parametrize("path", ["/orders", "/async/orders"])
def test_a_failing_request_leaves_neither_row_nor_message(
    path: str,
    http: TestClient,
    check: sa.Engine,
    broker_client: BrokerClient,
) -> None:
    before = stored_ids(broker_client, SUBJECT)
    customer = f"bob-{uuid.uuid4().hex[:8]}"
    with http:
        first = http.post(path, json={"customer": customer, "amount": "600.00"})
        assert first.status_code == 201, first.text
        # written and published, then refused before the commit: rolled back
        refused = http.post(path, json={"customer": customer, "amount": "600.00"})
        assert refused.status_code == 409, refused.text
    kept = first.json()["message_id"]
    assert orders(check) == [(customer, Decimal("600.00"))]
    assert {mid: status for mid, (status, _) in outbox_rows(check).items()} == {kept: "sent"}
    assert stored_ids(broker_client, SUBJECT) - before == Counter([kept])
