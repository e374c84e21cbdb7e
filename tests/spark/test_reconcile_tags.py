"""The reconciliation and tag filters: a message a group's filter skipped is settled for that
group (never leased, never acked, not reported unacked), read from a real broker's files."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import orjson
from pyspark.sql import SparkSession

from qmq_reconcile import readers
from qmq_reconcile.consumed import tag_filtered, unconsumed
from qmq_reconcile.transforms import Window, group_stats
from tests.spark.frames import NOW, OLD, actions, broker_messages, outbox_rows
from tests.support.broker_process import BrokerProcess

COLOURS = ("red", "green", "blue", "gold")


def test_a_filtered_message_is_settled_for_the_group_that_skipped_it(spark: SparkSession) -> None:
    messages = broker_messages(
        spark,
        [
            {"id": "m0", "tags": ["red"]},
            {"id": "m1", "tags": ["green"]},
            {"id": "m2", "tags": ["red", "vip"]},
            {"id": "m3"},  # no tags: no filter matches it
        ],
    )
    acts = actions(
        spark,
        [
            {"type": "group", "group": "reds", "start_seq": 0, "tags": ["red"]},
            {"type": "lease", "group": "reds", "seq": 0},
            {"type": "ack", "group": "reds", "seq": 0},
            {"type": "group", "group": "vips", "start_seq": 0, "tags": ["vip", "gold"]},
            {"type": "group", "group": "all", "start_seq": 0},
            # a filter a reset cleared: the later record fixes "none"
            {"type": "group", "group": "was-red", "start_seq": 0, "tags": ["red"]},
            {"type": "group", "group": "was-red", "start_seq": 0, "tags": [], "at": NOW},
        ],
    )
    rows = group_stats(messages, acts, now=NOW, ack_threshold=timedelta(0)).collect()
    got = {r["group"]: (r["acked"], r["unacked_past_threshold"]) for r in rows}
    assert got == {"reds": (1, 1), "vips": (0, 1), "all": (0, 4), "was-red": (0, 4)}


def test_group_stats_from_a_real_brokers_files_settle_the_filtered(
    spark: SparkSession, broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    broker = broker_factory(tmp_path / "data").start()
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        messages = [
            {"id": f"m{i}", "subject": "orders", "body": "{}", "tags": [COLOURS[i % 4]]}
            for i in range(8)
        ]
        post = {"content": orjson.dumps({"messages": messages})}
        headers = {"content-type": "application/json"}
        assert http.post("/v1/messages", headers=headers, **post).status_code == 200

        def pull(group: str, tags: list[str] | None, ack: list[int] | None = None) -> list[int]:
            doc = {"subject": "orders", "group": group, "consumer": "c", "tags": tags, "ack": ack}
            answer = http.post("/v1/pull", content=orjson.dumps(doc), headers=headers)
            assert answer.status_code == 200, answer.text
            return [m["seq"] for m in answer.json()["messages"]]

        reds = pull("reds", ["red"])
        assert reds == [0, 4]
        assert pull("reds", ["red"], ack=reds) == []
        assert pull("blues", ["blue"]) == [2, 6]  # leased, never acked
        assert pull("all", None) == list(range(8))  # leased, never acked
    broker.terminate()

    dirs = [str(broker.data_dir)]
    stored = readers.read_broker(spark, dirs, "messages")
    assert sorted((r["seq"], r["tags"]) for r in stored.collect()) == [
        (i, [COLOURS[i % 4]]) for i in range(8)
    ]
    acts = readers.read_broker(spark, dirs, "actions")
    later = datetime.now(UTC) + timedelta(hours=1)
    rows = group_stats(stored, acts, now=later, ack_threshold=timedelta(0)).collect()
    got = {r["group"]: (r["acked"], r["unacked_past_threshold"]) for r in rows}
    assert got == {"reds": (2, 0), "blues": (0, 2), "all": (0, 8)}


def test_what_a_groups_filter_skipped_is_not_reported_never_consumed(
    spark: SparkSession,
) -> None:
    """``--consumed``: the group's ``qmq_consumed`` rows hold only what its filter let
    through; the rest is settled for it, not "committed but never consumed"."""
    stored = [("m0", ["red"]), ("m1", ["green"]), ("m2", None), ("m3", ["red", "vip"])]
    messages = broker_messages(spark, [{"id": i, "tags": t} for i, t in stored])
    acts = actions(
        spark,
        [
            {"type": "group", "group": "reds", "start_seq": 0, "tags": ["red"]},
            {"type": "group", "group": "all", "start_seq": 0},
        ],
    )
    outbox = outbox_rows(
        spark, [{"message_id": i, "sent_at": OLD + timedelta(seconds=1)} for i, _ in stored]
    )
    consumed = spark.createDataFrame([("m0",)], "message_id string")  # m3 never came
    window = Window(now=NOW, grace=timedelta(minutes=5))

    def never(group: str) -> list[str]:
        filtered = tag_filtered(messages, acts, group=group, subjects=["orders"])
        found = unconsumed(
            outbox, consumed, window=window, subjects=["orders"], sent_before=NOW,
            filtered=filtered,
        )  # fmt: skip
        return sorted(r["message_id"] for r in found.collect())

    assert never("reds") == ["m3"]  # m1 and m2 filtered: settled for reds
    assert never("all") == ["m1", "m2", "m3"]  # no filter: every one was due
