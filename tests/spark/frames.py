"""Small DataFrames in the shapes the readers produce, for the transform tests."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from qmq_reconcile.datasource import ACTION_SCHEMA, MESSAGE_SCHEMA

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
OLD = NOW - timedelta(hours=1)

OUTBOX_SCHEMA = StructType(
    [
        StructField("outbox", StringType(), False),
        StructField("row_id", LongType(), False),
        StructField("message_id", StringType(), False),
        StructField("subject", StringType(), False),
        StructField("producer", StringType(), True),
        StructField("status", StringType(), False),
        StructField("body_sha256", StringType(), False),
        StructField("created_at", TimestampType(), False),
        StructField("sent_at", TimestampType(), True),
        StructField("deliver_at", TimestampType(), True),
    ]
)


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def outbox_rows(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    defaults = {
        "outbox": "db1",
        "subject": "orders",
        "producer": "orders-svc",
        "status": "sent",
        "body": b"{}",
        "created_at": OLD,
        "sent_at": None,
        "deliver_at": None,
    }
    data = []
    for number, row in enumerate(rows, start=1):
        r = {**defaults, **row}
        data.append(
            (
                r["outbox"],
                r.get("row_id", number),
                r["message_id"],
                r["subject"],
                r["producer"],
                r["status"],
                sha(r["body"]),
                r["created_at"],
                r["sent_at"],
                r["deliver_at"],
            )
        )
    return spark.createDataFrame(data, OUTBOX_SCHEMA)


def broker_messages(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    defaults = {
        "broker": "b1",
        "subject": "orders",
        "producer": "orders-svc",
        "partition": None,
        "key": None,
        "command": False,
        "body": b"{}",
        "created_at": OLD,
        "deliver_at": None,
        "tags": None,
    }
    data = []
    seqs: dict[tuple[str, str, int | None], int] = {}
    for number, row in enumerate(rows):
        r = {**defaults, **row}
        log = (r["broker"], r["subject"], r["partition"])
        seq = r.get("seq", seqs.get(log, 0))
        seqs[log] = seq + 1
        stored = r.get("stored_at", r["created_at"] + timedelta(milliseconds=10))
        data.append(
            (
                r["broker"],
                0,
                16 + number * 100,
                r["id"],
                r["subject"],
                r["partition"],
                seq,
                r["producer"],
                r["key"],
                r["command"],
                sha(r["body"]),
                r["created_at"],
                stored,
                r["deliver_at"],
                r["tags"],
            )
        )
    return spark.createDataFrame(data, MESSAGE_SCHEMA)


def actions(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    defaults = {
        "broker": "b1",
        "subject": "orders",
        "partition": None,
        "group": "g",
        "state": "",
        "seq": None,
        "at": OLD,
        "error": None,
        "start_seq": None,
        "tags": None,
    }
    data = []
    for row in rows:
        r = {**defaults, **row}
        data.append(tuple(r[name] for name in ACTION_SCHEMA.fieldNames()))
    return spark.createDataFrame(data, ACTION_SCHEMA)
