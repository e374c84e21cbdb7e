"""The outbox INSERT on PostgreSQL: psycopg's own connection and SQLAlchemy Core write the
same rows (the fast path must not change what lands in the table)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.rows import insert_rows, row_values
from qmq_outbox.schema import outbox_table


@pytest.fixture
def db_url(pg_url_migrated: str) -> str:
    return pg_url_migrated  # PostgreSQL alone here


COMPARED = [c for c in outbox_table.c if c.name not in ("id", "message_id")]


def values(message_id: str, **extra: object) -> dict[str, object]:
    now = datetime(2026, 11, 28, 9, 0, tzinfo=UTC)
    message = OutgoingMessage(
        id=message_id,
        subject="rows.s",
        body=b'{"a": 1}',
        headers={"trace": "x", "\u00e9": "\u00fc"},
        created_at=now,
        **extra,  # type: ignore[arg-type]
    )
    return row_values(message, "application/json")


def written(engine: sa.Engine, prefix: str) -> list[dict[str, object]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(*COMPARED, outbox_table.c.message_id)
            .where(outbox_table.c.message_id.startswith(prefix))
            .order_by(outbox_table.c.id)
        )
        return [{k: v for k, v in row._mapping.items() if k != "message_id"} for row in rows]


def test_the_driver_path_and_core_write_the_same_rows(engine: sa.Engine) -> None:
    assert engine.dialect.driver == "psycopg"
    later = datetime(2026, 11, 29, tzinfo=UTC) + timedelta(seconds=1)
    batches = [
        [values("one")],
        [values("two", key="k", tags=("red", "vip")), values("three", deliver_at=later)],
    ]
    with engine.begin() as conn:
        core = conn.execution_options(schema_translate_map={None: None})  # Core runs it
        for batch in batches:
            insert_rows(conn, [{**v, "message_id": f"fast-{v['message_id']}"} for v in batch])
            insert_rows(core, [{**v, "message_id": f"core-{v['message_id']}"} for v in batch])
    fast, core_rows = written(engine, "fast-"), written(engine, "core-")
    assert len(fast) == 3
    assert fast == core_rows
    assert fast[0]["headers"] == {"trace": "x", "\u00e9": "\u00fc"}
    assert [row["tags"] for row in fast] == [None, ["red", "vip"], None]


def test_a_rolled_back_transaction_leaves_no_row(engine: sa.Engine) -> None:
    with engine.connect() as conn, conn.begin() as transaction:
        insert_rows(conn, [values("gone")])
        transaction.rollback()
    assert written(engine, "gone") == []


def test_a_repeated_message_id_is_an_integrity_error_as_through_core(engine: sa.Engine) -> None:
    """What callers catch does not change with the path: SQLAlchemy's IntegrityError."""
    for options in ({}, {"schema_translate_map": {None: None}}):
        with engine.connect() as conn, conn.begin():
            bound = conn.execution_options(**options)
            insert_rows(bound, [values("twice")])
            with pytest.raises(sa.exc.IntegrityError, match="uq_qmq_outbox_message_id"):
                insert_rows(bound, [values("twice")])
