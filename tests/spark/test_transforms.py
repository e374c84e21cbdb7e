"""The reconciliation's transforms on small hand-made DataFrames."""

from __future__ import annotations

import math
import random
from datetime import timedelta

import pytest
from pyspark.sql import SparkSession

from qmq_reconcile.transforms import (
    CATEGORIES,
    HISTOGRAM_BOUNDS_MS,
    OUT_OF_ORDER_COLUMNS,
    Window,
    classify,
    group_stats,
    latency_samples,
    latency_stats,
    out_of_order,
)
from tests.spark.frames import NOW, OLD, actions, broker_messages, outbox_rows

pytestmark = pytest.mark.spark

WINDOW = Window(now=NOW, grace=timedelta(minutes=5))


def categories(frame: object) -> dict[str, str]:
    return {r["message_id"]: r["category"] for r in frame.collect()}  # type: ignore[attr-defined]


def test_every_category_with_its_precedence(spark: SparkSession) -> None:
    outbox = outbox_rows(
        spark,
        [
            {"message_id": "delivered"},
            {"message_id": "lost"},
            {"message_id": "stuck", "status": "pending"},
            {"message_id": "pending-stored", "status": "pending"},
            {"message_id": "dead", "status": "dead"},
            {"message_id": "dead-stored", "status": "dead"},
            {"message_id": "changed", "body": b"original"},
            {"message_id": "changed-pending", "status": "pending", "body": b"original"},
            {"message_id": "twice"},
            {"message_id": "twice-changed", "body": b"a"},
        ],
    )
    messages = broker_messages(
        spark,
        [
            {"id": "delivered"},
            {"id": "pending-stored"},
            {"id": "dead-stored"},
            {"id": "changed", "body": b"tampered"},
            {"id": "changed-pending", "body": b"tampered"},
            {"id": "twice"},
            {"id": "twice", "broker": "b2"},
            {"id": "twice-changed", "body": b"b"},
            {"id": "twice-changed", "body": b"a", "broker": "b2"},
            {"id": "orphan"},
        ],
    )
    got = categories(classify(outbox, messages, window=WINDOW))
    assert got == {
        "delivered": "delivered",
        "lost": "missing_in_broker",
        "stuck": "stuck_pending",
        "pending-stored": "pending_but_stored",
        "dead": "dead_in_outbox",
        "dead-stored": "dead_in_outbox",
        "changed": "body_mismatch",
        "changed-pending": "body_mismatch",
        "twice": "duplicate_in_broker",
        "twice-changed": "duplicate_in_broker",
        "orphan": "orphan_in_broker",
    }
    assert set(got.values()) == set(CATEGORIES)


def test_classified_rows_carry_both_sides(spark: SparkSession) -> None:
    outbox = outbox_rows(spark, [{"message_id": "m", "body": b"x"}])
    messages = broker_messages(
        spark, [{"id": "m", "body": b"y"}, {"id": "m", "broker": "b2", "body": b"y"}]
    )
    (row,) = classify(outbox, messages, window=WINDOW).collect()
    assert row["category"] == "duplicate_in_broker"
    assert row["brokers"] == ["b1", "b2"]
    assert row["broker_copies"] == 2
    assert row["outbox_rows"] == 1
    assert row["status"] == "sent"
    assert row["outbox"] == "db1"
    assert len(row["broker_sha256"]) == 1
    assert row["outbox_sha256"] != row["broker_sha256"]


def test_grace_excludes_young_messages_on_both_sides(spark: SparkSession) -> None:
    young = NOW - timedelta(minutes=1)
    outbox = outbox_rows(
        spark,
        [
            {"message_id": "young-pending", "status": "pending", "created_at": young},
            {"message_id": "young-sent", "created_at": young},
            {"message_id": "old-pending", "status": "pending"},
            {"message_id": "due-later", "deliver_at": NOW + timedelta(hours=2)},
        ],
    )
    messages = broker_messages(spark, [{"id": "young-orphan", "created_at": young}])
    got = categories(classify(outbox, messages, window=WINDOW))
    assert got == {"old-pending": "stuck_pending"}
    wider = Window(now=NOW, grace=timedelta(0))
    assert categories(classify(outbox, messages, window=wider)) == {
        "young-pending": "stuck_pending",
        "young-sent": "missing_in_broker",
        "old-pending": "stuck_pending",
        "young-orphan": "orphan_in_broker",
    }


def test_since_and_until_bound_created_at(spark: SparkSession) -> None:
    outbox = outbox_rows(
        spark,
        [
            {"message_id": "before", "created_at": OLD - timedelta(days=2)},
            {"message_id": "inside", "created_at": OLD - timedelta(days=1)},
            {"message_id": "at-until", "created_at": OLD},
        ],
    )
    messages = broker_messages(
        spark, [{"id": "orphan-inside", "created_at": OLD - timedelta(hours=30)}]
    )
    window = Window(
        now=NOW, since=OLD - timedelta(days=1, hours=7), until=OLD, grace=timedelta(minutes=5)
    )
    assert categories(classify(outbox, messages, window=window)) == {
        "inside": "missing_in_broker",
        "orphan-inside": "orphan_in_broker",
    }


def test_orphans_only_from_reconciled_producers(spark: SparkSession) -> None:
    outbox = outbox_rows(spark, [{"message_id": "row", "producer": "orders-svc"}])
    messages = broker_messages(
        spark,
        [
            {"id": "row", "producer": "orders-svc"},
            {"id": "ours", "producer": "orders-svc"},
            {"id": "theirs", "producer": "billing-svc"},
            {"id": "anonymous", "producer": None},
            {"id": "their-dup", "producer": "billing-svc"},
            {"id": "their-dup", "producer": "billing-svc", "broker": "b2"},
        ],
    )
    by_default = categories(classify(outbox, messages, window=WINDOW))
    assert by_default == {"row": "delivered", "ours": "orphan_in_broker"}
    explicit = categories(classify(outbox, messages, window=WINDOW, producers=["billing-svc"]))
    assert explicit == {
        "row": "delivered",
        "theirs": "orphan_in_broker",
        "their-dup": "duplicate_in_broker",
    }
    assert categories(classify(outbox, messages, window=WINDOW, producers=[])) == {
        "row": "delivered"
    }


def test_same_id_in_two_outboxes_counts_once(spark: SparkSession) -> None:
    outbox = outbox_rows(
        spark, [{"message_id": "m", "outbox": "db2"}, {"message_id": "m", "outbox": "db1"}]
    )
    messages = broker_messages(spark, [{"id": "m"}])
    (row,) = classify(outbox, messages, window=WINDOW).collect()
    assert (row["category"], row["outbox"], row["outbox_rows"]) == ("delivered", "db1", 2)


# --- groups ---------------------------------------------------------------------------------


def test_group_stats(spark: SparkSession) -> None:
    messages = broker_messages(
        spark, [{"id": f"m{i}", "stored_at": OLD + timedelta(seconds=i)} for i in range(6)]
    )
    acts = actions(
        spark,
        [
            {"type": "group", "group": "billing", "start_seq": 0},
            {"type": "lease", "group": "billing", "seq": 0},
            {"type": "ack", "group": "billing", "seq": 0},
            {"type": "ack", "group": "billing", "seq": 1},
            {"type": "ack", "group": "billing", "seq": 1, "at": NOW},  # a repeated ack
            {"type": "dead", "group": "billing", "seq": 2, "error": "boom"},
            {"type": "dead", "group": "billing", "seq": 3, "error": "boom"},
            {"type": "redrive", "group": "billing", "seq": 3, "at": OLD + timedelta(minutes=1)},
            # joined late: starts at seq 4
            {"type": "group", "group": "audit", "start_seq": 4},
            {"type": "lease", "group": "audit", "seq": 4},
            # broadcast: each consumer has its own state
            {"type": "group", "group": "cache", "state": "c1", "start_seq": 0},
            {"type": "group", "group": "cache", "state": "c2", "start_seq": 5},
            {"type": "ack", "group": "cache", "state": "c1", "seq": 0},
        ],
    )
    rows = group_stats(messages, acts, now=NOW, ack_threshold=timedelta(minutes=10)).collect()
    got = {r["group"]: r.asDict() for r in rows}
    assert got["billing"] == {
        "subject": "orders",
        "group": "billing",
        "mode": "shared",
        "acked": 2,
        "unacked_past_threshold": 3,  # 3 (redriven), 4, 5
        "dead_letters": 1,
        "never_acked": False,
    }
    assert got["audit"]["unacked_past_threshold"] == 2
    assert got["audit"]["never_acked"] is True
    assert got["cache"]["mode"] == "broadcast"
    assert got["cache"]["acked"] == 1
    assert got["cache"]["unacked_past_threshold"] == 5 + 1  # c1: seqs 1-5, c2: seq 5


def test_a_group_with_nothing_stored_and_nothing_acked_is_listed(spark: SparkSession) -> None:
    messages = broker_messages(spark, [{"id": "m0", "subject": "orders"}])
    acts = actions(
        spark,
        [
            {"type": "group", "subject": "refunds", "group": "late", "start_seq": 7},
            {"type": "lease", "subject": "refunds", "group": "lazy", "seq": 3},
        ],
    )
    rows = group_stats(messages, acts, now=NOW, ack_threshold=timedelta(0)).collect()
    got = {r["group"]: r.asDict() for r in rows}
    for name in ("late", "lazy"):
        assert got[name] == {
            "subject": "refunds",
            "group": name,
            "mode": "shared",
            "acked": 0,
            "unacked_past_threshold": 0,
            "dead_letters": 0,
            "never_acked": True,
        }


def test_ack_threshold_spares_recent_messages(spark: SparkSession) -> None:
    messages = broker_messages(
        spark,
        [
            {"id": "old", "stored_at": NOW - timedelta(hours=1)},
            {"id": "recent", "stored_at": NOW - timedelta(minutes=1)},
        ],
    )
    acts = actions(spark, [{"type": "group", "group": "g", "start_seq": 0}])
    (row,) = group_stats(messages, acts, now=NOW, ack_threshold=timedelta(minutes=10)).collect()
    assert row["unacked_past_threshold"] == 1
    (row,) = group_stats(messages, acts, now=NOW, ack_threshold=timedelta(0)).collect()
    assert row["unacked_past_threshold"] == 2


# --- latency --------------------------------------------------------------------------------


def test_latency_percentiles_and_histogram(spark: SparkSession) -> None:
    rows = [
        {"id": f"m{i}", "created_at": OLD, "stored_at": OLD + timedelta(milliseconds=i + 1)}
        for i in range(100)
    ]
    messages = broker_messages(spark, rows)
    acts = actions(
        spark,
        [
            {"type": "ack", "seq": 0, "at": OLD + timedelta(seconds=2, milliseconds=1)},
            {"type": "ack", "seq": 0, "at": OLD + timedelta(seconds=9)},  # later: ignored
            {"type": "ack", "seq": 1, "at": OLD + timedelta(seconds=4, milliseconds=2)},
        ],
    )
    samples = latency_samples(messages, acts)
    stats = {r["metric"]: r for r in latency_stats(samples)}
    created = stats["created_to_stored"]
    assert created["count"] == 100
    assert created["p50"] == pytest.approx(50.0)
    assert created["p90"] == pytest.approx(90.0)
    assert created["p99"] == pytest.approx(99.0)
    assert created["max"] == pytest.approx(100.0)
    acked = stats["stored_to_acked"]
    assert acked["count"] == 2
    assert acked["max"] == pytest.approx(4000.0)
    assert acked["p50"] == pytest.approx(2000.0)
    below = dict(zip(HISTOGRAM_BOUNDS_MS, range(len(HISTOGRAM_BOUNDS_MS)), strict=True))
    assert len(created["histogram"]) == len(HISTOGRAM_BOUNDS_MS) + 1  # the last is open
    assert created["histogram"][below[2]] == 1  # 1 ms
    assert created["histogram"][below[5]] == 3  # 2, 3, 4 ms
    assert created["histogram"][below[200]] == 1  # 100 ms
    assert sum(created["histogram"]) == 100
    assert acked["histogram"][below[5_000]] == 2
    assert sum(acked["histogram"]) == 2


def test_latency_percentiles_are_nearest_rank_within_half_a_percent(
    spark: SparkSession,
) -> None:
    """Spread over ten decades, zero and a negative (clock skew) included: every percentile
    is within 0.5% of the exact nearest-rank one, counts and max exact."""
    generator = random.Random(7)
    values = [10 ** generator.uniform(-3, 7) for _ in range(5_000)] + [0.0, -3.25]
    samples = spark.createDataFrame(
        [("created_to_stored", v) for v in values], "metric string, ms double"
    )
    [stats] = latency_stats(samples)
    ordered = sorted(values)
    assert stats["count"] == len(values)
    assert stats["max"] == max(values)
    for name, fraction in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        exact = ordered[math.ceil(fraction * len(values)) - 1]
        assert stats[name] == pytest.approx(exact, rel=0.005), name
    assert sum(stats["histogram"]) == len(values)
    assert stats["histogram"][0] == sum(1 for v in values if v < HISTOGRAM_BOUNDS_MS[0])


# --- ordered subjects -------------------------------------------------------------------------

COMMAND = {"producer": "_qmq", "command": True, "created_at": OLD}


def test_command_messages_are_in_no_category(spark: SparkSession) -> None:
    outbox = outbox_rows(spark, [{"message_id": "m1", "subject": "ledger"}])
    messages = broker_messages(
        spark,
        [
            {"id": "m1", "subject": "ledger", "partition": 0},
            {"id": "_qmq.route.2.0", "subject": "ledger", "partition": 0, **COMMAND},
            # the same command stored again after a crash is no duplicate either
            {"id": "_qmq.route.2.0", "subject": "ledger", "partition": 0, **COMMAND},
        ],
    )
    # Even with its producer reconciled, a command message is no orphan.
    classified = classify(outbox, messages, window=WINDOW, producers=["orders-svc", "_qmq"])
    assert categories(classified) == {"m1": "delivered"}
    assert [r["subject"] for r in classified.collect()] == ["ledger"]


def test_group_stats_sum_an_ordered_subjects_partitions_and_skip_commands(
    spark: SparkSession,
) -> None:
    messages = broker_messages(
        spark,
        [
            {"id": "a0", "subject": "ledger", "partition": 0},  # seq 0 of partition 0
            {"id": "a1", "subject": "ledger", "partition": 0},
            {"id": "_qmq.route.2.0", "subject": "ledger", "partition": 0, **COMMAND},
            {"id": "b0", "subject": "ledger", "partition": 1},  # seq 0 of partition 1
            {"id": "c0", "subject": "ledger", "partition": 2},  # after the split
            {"id": "_qmq.route.2.1", "subject": "ledger", "partition": 1, **COMMAND},
        ],
    )
    on = {"subject": "ledger", "group": "billing"}
    acts = actions(
        spark,
        [
            {"type": "group", "partition": 0, "start_seq": 0, **on},
            {"type": "ack", "partition": 0, "seq": 0, **on},
            {"type": "ack", "partition": 0, "seq": 1, **on},
            {"type": "ack", "partition": 0, "seq": 2, **on},  # the broker consumes the command
            {"type": "group", "partition": 1, "start_seq": 0, **on},
            {"type": "ack", "partition": 1, "seq": 0, **on},
            {"type": "group", "partition": 2, "start_seq": 0, **on},
        ],
    )
    rows = group_stats(messages, acts, now=NOW, ack_threshold=timedelta(0)).collect()
    assert [r.asDict() for r in rows] == [
        {
            "subject": "ledger",
            "group": "billing",
            "mode": "ordered",
            "acked": 3,  # a0, a1, b0: not the command
            "unacked_past_threshold": 1,  # c0: not partition 1's unconsumed command
            "dead_letters": 0,
            "never_acked": False,
        }
    ]
    samples = latency_samples(messages, acts).collect()
    counted = {m: sum(1 for r in samples if r["metric"] == m) for m in ("created_to_stored",)}
    assert counted == {"created_to_stored": 4}
    assert sum(1 for r in samples if r["metric"] == "stored_to_acked") == 3


def ordered_rows(
    spark: SparkSession, stored: list[dict[str, object]], outbox: list[dict[str, object]]
) -> list[dict[str, object]]:
    found = out_of_order(
        outbox_rows(spark, outbox), broker_messages(spark, stored), window=WINDOW
    ).collect()
    assert all(list(r.asDict()) == list(OUT_OF_ORDER_COLUMNS) for r in found)
    return sorted((r.asDict() for r in found), key=lambda r: str(r["message_id"]))


def at(minutes: int) -> dict[str, object]:
    return {"stored_at": OLD + timedelta(minutes=minutes)}


def test_out_of_order_within_a_log_is_by_seq(spark: SparkSession) -> None:
    # Outbox ids 1..4 for k1 (a1..a4); stored a1, a3, a2, a4: a2 came after a3.
    outbox = [{"message_id": f"a{n}", "row_id": n} for n in range(1, 5)]
    outbox += [{"message_id": "b1", "row_id": 9}]
    stored = [
        {"id": "a1", "key": "k1", "partition": 0, **at(1)},
        {"id": "a3", "key": "k1", "partition": 0, **at(2)},
        {"id": "a2", "key": "k1", "partition": 0, **at(2)},  # same produce call: by seq
        {"id": "a4", "key": "k1", "partition": 0, **at(3)},
        {"id": "b1", "key": "k2", "partition": 1, **at(0)},
    ]
    (found,) = ordered_rows(spark, stored, outbox)
    assert found == {
        "subject": "orders",
        "key": "k1",
        "message_id": "a2",
        "outbox": "db1",
        "outbox_id": 2,
        "broker": "b1",
        "partition": 0,
        "seq": 2,
        "stored_at": (OLD + timedelta(minutes=2)).replace(tzinfo=None),  # collected: UTC
        "after_id": "a3",
        "after_outbox_id": 3,
    }


def test_out_of_order_across_partitions_is_by_stored_time(spark: SparkSession) -> None:
    outbox = [{"message_id": f"c{n}", "row_id": n} for n in range(1, 4)]
    stored = [
        {"id": "c2", "key": "k", "partition": 0, **at(1)},
        {"id": "c1", "key": "k", "partition": 2, **at(2)},  # moved by a split, stored later
        {"id": "c3", "key": "k", "partition": 2, **at(3)},
    ]
    (found,) = ordered_rows(spark, stored, outbox)
    assert (found["message_id"], found["partition"], found["after_id"]) == ("c1", 2, "c2")


def test_out_of_order_compares_one_outbox_and_first_copies_only(spark: SparkSession) -> None:
    outbox = [
        {"message_id": "x2", "row_id": 2, "outbox": "db1"},
        {"message_id": "y1", "row_id": 1, "outbox": "db2"},  # another database's ids
        {"message_id": "x3", "row_id": 3, "outbox": "db1"},
        {"message_id": "young", "row_id": 4, "outbox": "db1", "created_at": NOW},
        {"message_id": "plain", "row_id": 5, "outbox": "db1"},
    ]
    stored = [
        {"id": "x2", "key": "k", **at(1)},
        {"id": "x3", "key": "k", **at(2)},
        {"id": "y1", "key": "k", **at(3)},
        {"id": "x2", "key": "k", "broker": "b2", **at(4)},  # a resend stored again
        {"id": "young", "key": "k", **at(0)},  # in flight: not judged
        {"id": "plain", **at(0)},  # no key: no order to keep
        {"id": "_qmq.route.2.0", "partition": 0, **COMMAND, **at(0)},
    ]
    assert ordered_rows(spark, stored, outbox) == []
