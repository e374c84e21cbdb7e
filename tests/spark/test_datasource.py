"""The ``qmq-log`` data source: segments to Arrow batches, one partition per segment."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from qmq_broker.format import ActionRecord, ActionType, SegmentKind
from qmq_reconcile import readers
from qmq_reconcile.datasource import (
    ACTION_SCHEMA,
    MESSAGE_SCHEMA,
    action_batches,
    action_types,
    message_batches,
    with_unreadable,
)
from tests.spark.segments import T0, flip_byte, frame_offsets, message, write_segment

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


def test_partition_logs_read_as_their_subject_and_commands_are_marked(tmp_path: Path) -> None:
    records = [
        message(0, subject="ledger#3", key="acct-1"),
        message(
            1,
            id="_qmq.route.2.3",
            subject="ledger#3",
            producer="_qmq",
            headers={"qmq-command": "route", "qmq-route-version": "2"},
        ),
        message(0, id="plain", subject="orders"),
    ]
    path = write_segment(tmp_path, SegmentKind.MESSAGES, 0, records)
    rows = [r for b in message_batches("b1", path) for r in b.to_pylist()]
    assert [(r["id"], r["subject"], r["partition"], r["command"]) for r in rows] == [
        ("m0", "ledger", 3, False),
        ("_qmq.route.2.3", "ledger", 3, True),
        ("plain", "orders", None, False),
    ]
    acks = [
        ActionRecord(type=ActionType.ACK, at_us=T0, subject="ledger#3", group="g", seqs=(1,)),
        ActionRecord(type=ActionType.ACK, at_us=T0, subject="orders", group="g", seqs=(0,)),
    ]
    path = write_segment(tmp_path, SegmentKind.ACTIONS, 0, acks)
    acked = [r for b in action_batches("b1", path) for r in b.to_pylist()]
    assert [(r["subject"], r["partition"], r["seq"]) for r in acked] == [
        ("ledger", 3, 1),
        ("orders", None, 0),
    ]


def torn_frame(seq: int) -> bytes:
    """The first bytes of a message frame whose write was cut short."""
    payload = message(seq).encode()
    return len(payload).to_bytes(4, "little") + b"\x00\x00\x00\x00" + payload[:5]


def test_a_torn_tail_ends_the_segment(tmp_path: Path) -> None:
    whole = [message(0), message(1)]
    path = write_segment(tmp_path, SegmentKind.MESSAGES, 0, whole, tail=torn_frame(2))
    rows = [r for b in message_batches("b1", path) for r in b.to_pylist()]
    assert [r["seq"] for r in rows] == [0, 1]


def test_a_flipped_byte_costs_one_record_and_gives_one_region(tmp_path: Path) -> None:
    records = [message(i, body=b"body-%d" % i) for i in range(10)]
    path = write_segment(tmp_path, SegmentKind.MESSAGES, 3, records)
    offset, length = frame_offsets(records)[4]
    flip_byte(path, offset + length - 2)  # inside message 4's body: its CRC fails
    plain = [r for b in message_batches("b1", path) for r in b.to_pylist()]
    assert [r["seq"] for r in plain] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    batches = list(message_batches("b1", path, unreadable=True, batch_rows=4))
    assert batches[0].schema.names == [*MESSAGE_SCHEMA.fieldNames(), "unreadable"]
    rows = [r for b in batches for r in b.to_pylist()]
    region = {"segment": 3, "offset": offset, "length": length}
    assert [r["unreadable"] for r in rows] == [None] * 4 + [region] + [None] * 5
    assert {k: v for k, v in rows[4].items() if v is not None} == {
        "broker": "b1",
        "unreadable": region,
    }
    assert [r["seq"] for r in rows if r["unreadable"] is None] == [r["seq"] for r in plain]


def test_a_torn_tail_is_damage_only_before_the_last_segment(tmp_path: Path) -> None:
    records = [message(0), message(1)]
    path = write_segment(tmp_path, SegmentKind.MESSAGES, 0, records, tail=torn_frame(2))
    end = sum(frame_offsets(records)[-1])

    def regions(*, last_segment: bool) -> list[object]:
        batches = message_batches("b1", path, unreadable=True, last_segment=last_segment)
        return [r["unreadable"] for b in batches for r in b.to_pylist() if r["unreadable"]]

    assert regions(last_segment=True) == []
    assert regions(last_segment=False) == [
        {"segment": 0, "offset": end, "length": len(torn_frame(2))}
    ]


def test_a_damaged_action_record_gives_one_region(tmp_path: Path) -> None:
    acks = [
        ActionRecord(type=ActionType.ACK, at_us=T0 + n, subject="orders", group="g", seqs=(n,))
        for n in range(4)
    ]
    path = write_segment(tmp_path, SegmentKind.ACTIONS, 2, acks)
    offset, length = frame_offsets(acks)[1]
    flip_byte(path, offset + 3)  # the frame's length field
    rows = [
        r
        for b in action_batches("b1", path, types=action_types("ack"), unreadable=True)
        for r in b.to_pylist()
    ]
    assert [(r["seq"], r["unreadable"]) for r in rows] == [
        (0, None),
        (None, {"segment": 2, "offset": offset, "length": length}),
        (2, None),
        (3, None),
    ]


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


def test_spark_reads_regions_with_the_unreadable_option(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_segment(tmp_path, SegmentKind.MESSAGES, 0, [message(0)], tail=torn_frame(1))
    write_segment(tmp_path, SegmentKind.MESSAGES, 1, [message(2)], tail=torn_frame(3))
    frame = (
        spark.read.format("qmq-log").option("kind", "messages").option("unreadable", "true")
    ).load(str(tmp_path))
    assert frame.schema == with_unreadable(MESSAGE_SCHEMA)
    rows = sorted(frame.collect(), key=lambda r: r["seq"] if r["seq"] is not None else -1)
    # Segment 0's torn tail is damage (segment 1 follows it); segment 1's is a torn write.
    assert [(r["seq"], r["unreadable"] and r["unreadable"]["segment"]) for r in rows] == [
        (None, 0),
        (0, None),
        (2, None),
    ]
    plain = spark.read.format("qmq-log").option("kind", "messages").load(str(tmp_path))
    assert plain.schema == MESSAGE_SCHEMA
    assert sorted(r["seq"] for r in plain.collect()) == [0, 2]


def test_action_types_read_only_those_types(tmp_path: Path) -> None:
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


def test_small_data_is_read_in_the_driver_with_the_same_rows(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = ActionRecord(
        type=ActionType.LEASE, at_us=T0, subject="orders", group="g", seqs=(0,),
        fields={"consumer": "c", "deadline": T0, "attempts": [1]},
    )  # fmt: skip
    ack = ActionRecord(type=ActionType.ACK, at_us=T0 + 1, subject="orders", group="g", seqs=(0,))
    write_segment(tmp_path, SegmentKind.MESSAGES, 0, [message(0)], tail=torn_frame(1))
    write_segment(tmp_path, SegmentKind.MESSAGES, 1, [message(2, key="k")])
    write_segment(tmp_path, SegmentKind.ACTIONS, 0, [lease, ack])
    dirs = [str(tmp_path)]

    def rows(kind: str) -> list[tuple[object, ...]]:
        frame = readers.read_broker(spark, dirs, kind)
        assert frame.schema == with_unreadable(
            MESSAGE_SCHEMA if kind == "messages" else ACTION_SCHEMA
        )
        return sorted((tuple(r) for r in frame.collect()), key=repr)

    in_driver = {kind: rows(kind) for kind in ("messages", "actions")}
    monkeypatch.setattr(readers, "IN_DRIVER_MAX_BYTES", 0)  # now through qmq-log
    monkeypatch.setattr(readers, "LOCAL_IN_DRIVER_MAX_BYTES", 0)
    assert in_driver == {kind: rows(kind) for kind in ("messages", "actions")}
    assert len(in_driver["messages"]) == 3  # two records and segment 0's damaged tail
    assert [r[5] for r in in_driver["actions"]] == ["ack"]  # leases are not read
    empty = tmp_path / "empty"
    write_segment(empty, SegmentKind.MESSAGES, 0, [])
    monkeypatch.undo()
    assert readers.read_broker(spark, [str(empty)], "actions").count() == 0
    assert readers.read_broker(spark, [str(empty)], "messages").count() == 0
