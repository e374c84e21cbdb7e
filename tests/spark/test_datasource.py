"""The ``qmq-log`` data source: segments to Arrow batches, one partition per segment."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from broker.format import ActionRecord, ActionType, SegmentKind
from spark_reconcile.datasource import (
    ACTION_SCHEMA,
    MESSAGE_SCHEMA,
    action_batches,
    action_types,
    message_batches,
)
from tests.spark.segments import T0, message, write_segment

pytestmark = pytest.mark.spark


def test_message_batches_decode_with_the_format_module(tmp_path: Path) -> None:
    records = [message(i, body=b"body-%d" % i) for i in range(5)]
    records.append(message(5, key="k", producer=None, deliver_at_us=T0 + 10**9))
    path = write_segment(tmp_path, SegmentKind.MESSAGES, 7, records)
    batches = list(message_batches("b1", path, batch_rows=2))
    assert [b.num_rows for b in batches] == [2, 2, 2]
    rows = [row for b in batches for row in b.to_pylist()]
    assert [r["id"] for r in rows] == [f"m{i}" for i in range(6)]
    first, last = rows[0], rows[-1]
    assert first["broker"] == "b1"
    assert first["segment"] == 7
    assert first["offset"] == 16
    assert first["body_sha256"] == hashlib.sha256(b"body-0").hexdigest()
    assert first["created_at"] == datetime(2025, 1, 1, 12, tzinfo=UTC)
    assert first["deliver_at"] is None
    assert (last["key"], last["producer"]) == ("k", None)
    assert last["deliver_at"] == datetime(2025, 1, 1, 12, 16, 40, tzinfo=UTC)
    assert batches[0].schema.names == MESSAGE_SCHEMA.fieldNames()


def test_a_torn_tail_ends_the_segment(tmp_path: Path) -> None:
    whole = [message(0), message(1)]
    torn = message(2).encode()
    tail = len(torn).to_bytes(4, "little") + b"\x00\x00\x00\x00" + torn[:5]
    path = write_segment(tmp_path, SegmentKind.MESSAGES, 0, whole, tail=tail)
    rows = [r for b in message_batches("b1", path) for r in b.to_pylist()]
    assert [r["seq"] for r in rows] == [0, 1]


def test_action_batches_explode_seqs(tmp_path: Path) -> None:
    records = [
        ActionRecord(
            type=ActionType.GROUP,
            at_us=T0,
            subject="orders",
            group="g",
            fields={"mode": "shared", "cursor": 3},
        ),
        ActionRecord(type=ActionType.ACK, at_us=T0 + 1, subject="orders", group="g", seqs=(3, 4)),
        ActionRecord(
            type=ActionType.DEAD,
            at_us=T0 + 2,
            subject="orders",
            group="g",
            state="c1",
            seqs=(5,),
            fields={"error": "boom"},
        ),
    ]
    path = write_segment(tmp_path, SegmentKind.ACTIONS, 0, records)
    rows = [r for b in action_batches("b1", path) for r in b.to_pylist()]
    assert [(r["type"], r["seq"], r["start_seq"], r["error"], r["state"]) for r in rows] == [
        ("group", None, 3, None, ""),
        ("ack", 3, None, None, ""),
        ("ack", 4, None, None, ""),
        ("dead", 5, None, "boom", "c1"),
    ]
    assert list(rows[0]) == ACTION_SCHEMA.fieldNames()


def test_spark_reads_one_partition_per_segment(spark: SparkSession, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_segment(a, SegmentKind.MESSAGES, 0, [message(0), message(1)])
    write_segment(a, SegmentKind.MESSAGES, 1, [message(2)])
    write_segment(b, SegmentKind.MESSAGES, 0, [message(0, id="x")])
    write_segment(
        b,
        SegmentKind.ACTIONS,
        0,
        [ActionRecord(type=ActionType.ACK, at_us=T0, subject="orders", group="g", seqs=(0,))],
    )
    frame = (
        spark.read.format("qmq-log")
        .option("kind", "messages")
        .option("paths", json.dumps([str(a), str(b)]))
        .load()
    )
    assert frame.rdd.getNumPartitions() == 3
    got = sorted((r["broker"] == str(a), r["id"]) for r in frame.collect())
    assert got == [(False, "x"), (True, "m0"), (True, "m1"), (True, "m2")]
    acts = spark.read.format("qmq-log").option("kind", "actions").load(str(a))
    assert acts.count() == 0  # no actions/ folder: an empty frame
    acked = spark.read.format("qmq-log").option("kind", "actions").load(str(b)).collect()
    assert [(r["type"], r["seq"]) for r in acked] == [("ack", 0)]


def test_action_types_skip_other_records_undecoded(tmp_path: Path) -> None:
    lease = ActionRecord(
        type=ActionType.LEASE,
        at_us=T0,
        subject="orders",
        group="g",
        seqs=(0, 1),
        fields={"consumer": "c", "deadline": T0, "attempts": [1, 1]},
    )
    ack = ActionRecord(type=ActionType.ACK, at_us=T0 + 1, subject="orders", group="g", seqs=(0,))
    path = write_segment(tmp_path, SegmentKind.ACTIONS, 0, [lease, ack])
    everything = [r["type"] for b in action_batches("b1", path) for r in b.to_pylist()]
    assert everything == ["lease", "lease", "ack"]
    acks_only = action_batches("b1", path, types=action_types("ack, dead"))
    assert [r["type"] for b in acks_only for r in b.to_pylist()] == ["ack"]
    with pytest.raises(ValueError, match="unknown type"):
        action_types("ack,bogus")
