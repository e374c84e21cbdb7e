"""Reading outboxes over JDBC (SQLite, PostgreSQL) and checking broker data directories."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pyspark.sql import SparkSession

from qmq_broker.format import SegmentKind
from qmq_outbox.schema import metadata, outbox_table
from qmq_reconcile.errors import (
    BadOutboxUrl,
    BrokerDataUnreadable,
    OutboxUnreadable,
    UnreadablePath,
)
from qmq_reconcile.readers import (
    OUTBOX_COLUMNS,
    check_broker_dir,
    jdbc_source,
    read_outbox,
    read_outboxes,
)
from tests.spark.segments import message, write_segment
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.spark

CREATED = datetime(2025, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


def rows(count: int, prefix: str = "m") -> list[dict[str, Any]]:
    return [
        {
            "message_id": f"{prefix}{i}",
            "subject": "orders",
            "headers": {},
            "body": b"\x00body-%d\xff" % i,
            "content_type": "application/octet-stream",
            "producer": "orders-svc",
            "status": "sent" if i % 2 else "pending",
            "next_attempt_at": CREATED,
            "created_at": CREATED + timedelta(seconds=i),
            "sent_at": CREATED + timedelta(seconds=i, milliseconds=5) if i % 2 else None,
        }
        for i in range(count)
    ]


def make_outbox(url: str, count: int) -> None:
    engine = sa.create_engine(url)
    try:
        metadata.create_all(engine, tables=[outbox_table])
        if count:
            with engine.begin() as conn:
                conn.execute(outbox_table.insert(), rows(count))
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def pg_outbox(pg_admin_url: str) -> Iterator[str]:
    with fresh_database(pg_admin_url, prefix="qmq_reconcile") as url:
        make_outbox(url, 10)
        yield url


# --- URLs -----------------------------------------------------------------------------------


def test_postgres_url_becomes_jdbc() -> None:
    source = jdbc_source("postgresql+psycopg://app:s3cret@db.local:6543/orders?sslmode=require")
    assert source.jdbc_url == "jdbc:postgresql://db.local:6543/orders?sslmode=require"
    assert source.properties == {"user": "app", "password": "s3cret"}
    assert source.driver == "org.postgresql.Driver"
    assert "s3cret" not in source.label


def test_sqlite_url_becomes_jdbc(tmp_path: Path) -> None:
    db = tmp_path / "outbox.db"
    make_outbox(f"sqlite:///{db}", 0)
    source = jdbc_source(f"sqlite:///{db}")
    assert source.jdbc_url == f"jdbc:sqlite:{db}"
    assert source.dialect == "sqlite"


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("not a url", BadOutboxUrl),
        ("mysql+pymysql://u@h/db", BadOutboxUrl),
        ("postgresql+psycopg://u@h", BadOutboxUrl),
        ("sqlite://", BadOutboxUrl),
        ("sqlite:////nonexistent/outbox.db", UnreadablePath),
    ],
)
def test_bad_urls(url: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        jdbc_source(url)


def test_a_file_that_is_not_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    path.write_bytes(b"definitely not a database")
    with pytest.raises(UnreadablePath, match="not a SQLite database"):
        jdbc_source(f"sqlite:///{path}")


# --- broker directories -----------------------------------------------------------------------


def test_broker_dir_checks(tmp_path: Path) -> None:
    with pytest.raises(UnreadablePath, match="does not exist"):
        check_broker_dir(str(tmp_path / "missing"))
    with pytest.raises(UnreadablePath, match="not a broker data directory"):
        check_broker_dir(str(tmp_path))
    good = tmp_path / "good"
    write_segment(good, SegmentKind.MESSAGES, 0, [message(0)])
    assert check_broker_dir(str(good)) == str(good)
    bad = tmp_path / "bad"
    path = write_segment(bad, SegmentKind.MESSAGES, 0, [message(0)])
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(BrokerDataUnreadable, match="bad magic"):
        check_broker_dir(str(bad))
    (good / "FORMAT").write_text('{"format": 99}')
    with pytest.raises(BrokerDataUnreadable, match="format 99"):
        check_broker_dir(str(good))


# --- JDBC reads -------------------------------------------------------------------------------


def check_rows(collected: list[Any], count: int) -> None:
    by_id = {r["message_id"]: r for r in collected}
    assert len(by_id) == count
    first = by_id["m1"]
    assert first["body_sha256"] == hashlib.sha256(b"\x00body-1\xff").hexdigest()
    assert first["status"] == "sent"
    assert first["producer"] == "orders-svc"
    assert first["created_at"].replace(tzinfo=UTC) == CREATED + timedelta(seconds=1)
    assert first["sent_at"].replace(tzinfo=UTC) == CREATED + timedelta(seconds=1, milliseconds=5)
    assert by_id["m0"]["sent_at"] is None
    assert by_id["m0"]["deliver_at"] is None


def test_sqlite_outbox_read_in_partitions(spark: SparkSession, tmp_path: Path) -> None:
    db = tmp_path / "outbox.db"
    make_outbox(f"sqlite:///{db}", 10)
    frame = read_outbox(spark, jdbc_source(f"sqlite:///{db}"), partitions=3)
    assert tuple(frame.columns) == OUTBOX_COLUMNS
    assert frame.rdd.getNumPartitions() == 3
    check_rows(frame.collect(), 10)


def test_postgres_outbox_read_in_partitions(spark: SparkSession, pg_outbox: str) -> None:
    frame = read_outbox(spark, jdbc_source(pg_outbox), partitions=4, fetchsize=3)
    assert frame.rdd.getNumPartitions() == 4
    check_rows(frame.collect(), 10)


def test_two_outboxes_in_one_frame(spark: SparkSession, pg_outbox: str, tmp_path: Path) -> None:
    db = tmp_path / "outbox.db"
    make_outbox(f"sqlite:///{db}", 0)
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(outbox_table.insert(), rows(3, prefix="s"))
    engine.dispose()
    sources = [jdbc_source(pg_outbox), jdbc_source(f"sqlite:///{db}")]
    frame = read_outboxes(spark, sources)
    counts = {r["outbox"]: r["count"] for r in frame.groupBy("outbox").count().collect()}
    assert counts == {sources[0].label: 10, sources[1].label: 3}


def test_an_empty_outbox(spark: SparkSession, tmp_path: Path) -> None:
    db = tmp_path / "outbox.db"
    make_outbox(f"sqlite:///{db}", 0)
    assert read_outbox(spark, jdbc_source(f"sqlite:///{db}")).count() == 0


def test_an_unreachable_or_foreign_database(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(OutboxUnreadable, match=r"127\.0\.0\.1:1"):
        read_outbox(spark, jdbc_source("postgresql+psycopg://u:p@127.0.0.1:1/db"))
    db = tmp_path / "other.db"
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x INTEGER)"))
    engine.dispose()
    for partitions in (None, 1):  # one read skips the bounds query: load() still fails
        with pytest.raises(OutboxUnreadable, match="qmq_outbox"):
            read_outbox(spark, jdbc_source(f"sqlite:///{db}"), partitions=partitions)


def test_one_partition_reads_without_bounds(spark: SparkSession, pg_outbox: str) -> None:
    frame = read_outbox(spark, jdbc_source(pg_outbox), partitions=1)
    assert frame.rdd.getNumPartitions() == 1
    check_rows(frame.collect(), 10)
