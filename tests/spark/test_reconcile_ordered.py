"""An ordered subject end to end: partitions summed under their subject, command messages
left out, messages stored out of their outbox order found.

The broker data is written in-process by the broker's own engine (``qmq_broker.engine.Broker``,
as ``bench/reconcile.py`` does); the outbox is a fresh PostgreSQL database whose rows are
inserted in outbox-id order a1, a2, a3, b1, b2, b3, c1, c2 (one key per letter), plus an
unkeyed row on a plain subject. ``ledger`` is ordered with two partitions; the broker is
given:

====  ======================================================================  ==========
step  produced                                                                 out of order
====  ======================================================================  ==========
1     a1, a3 (one request), then a2: a2 stored after a3, in the same partition  a2
2     b1, b2, and c2
3     the partition of key c is split: a command message closes it
4     c1 (now in a new partition, stored after c2), b3                          c1
====  ======================================================================  ==========

Group ``billing`` then consumes everything in ordered mode, so the broker also consumes
the command (it acks it for the group) and the group moves to the new partitions. Group
``replay`` consumes it too, but acks each batch one message at a time from its last to its
first, as a consumer running a batch's handlers concurrently might: each message that has
a message of its key stored ahead of it in its batch is acked out of order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession

from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.engine import Broker
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics
from qmq_reconcile import CATEGORIES, reconcile
from qmq_reconcile.readers import read_broker
from qmq_wire.ordered import COMMAND_PRODUCER, command_id, logic_partition
from tests.spark.worlds import body, insert, row
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.spark

LEDGER, AUDIT, PRODUCER, GROUP, SLOPPY = "ledger", "audit.log", "ledger-svc", "billing", "replay"
KEYS = {"a": "acct-a", "b": "acct-b", "c": "acct-c"}
OUTBOX_ORDER = ["a1", "a2", "a3", "b1", "b2", "b3", "c1", "c2"]
SPLIT_VERSION = 2


@dataclass(frozen=True)
class World:
    outbox: str
    broker_dir: Path
    closed: int  # the partition the split closed
    acked_early: frozenset[str]  # the messages group replay acked out of order


def incoming(name: str, created: datetime) -> IncomingMessage:
    return IncomingMessage(
        id=name,
        subject=AUDIT if name == "plain" else LEDGER,
        key=None if name == "plain" else KEYS[name[0]],
        headers={},
        body=body(name),
        body_base64=False,
        producer=PRODUCER,
        created_at_us=int(created.timestamp() * 1_000_000),
        deliver_at_us=0,
    )


async def consume(broker: Broker, group: str = GROUP) -> tuple[int, frozenset[str]]:
    """Pull and ack ``ledger`` for ``group`` in ordered mode until nothing comes; how many
    messages it got and, for the sloppy group (acks one by one, last first), the ids it
    acked before a message of the same key stored ahead of them in the same batch."""
    got, idle, early = 0, 0, set()
    while idle < 3:
        pulled, _ = await broker.services.delivery.ack_and_pull(
            ack=None,
            subject=LEDGER, group=group, consumer="c1", max_messages=100, wait_ms=0,
            mode="ordered", start="earliest",
        )  # fmt: skip
        idle = 0 if pulled else idle + 1
        got += len(pulled)
        batches: dict[int, list[dict[str, Any]]] = {}
        for message in pulled:
            batches.setdefault(message["partition"], []).append(message)
        for partition, batch in batches.items():
            seqs = [m["seq"] for m in batch]
            if group != SLOPPY:
                await broker.services.delivery.ack(
                    subject=LEDGER, group=group, consumer="c1", seqs=seqs, partition=partition
                )
                continue
            for seq in reversed(seqs):
                await broker.services.delivery.ack(
                    subject=LEDGER, group=group, consumer="c1", seqs=[seq], partition=partition
                )
            keys = [m["key"] for m in batch]
            early |= {m["id"] for n, m in enumerate(batch) if m["key"] in keys[:n]}
    return got, frozenset(early)


async def write_broker(data_dir: Path, created: dict[str, datetime]) -> tuple[int, frozenset[str]]:
    """The broker data of the table above; returns the partition the split closed and
    the messages group replay acked out of order."""
    broker = Broker(
        BrokerConfig(data_dir=data_dir, fsync=FsyncPolicy(mode="never")), metrics=BrokerMetrics()
    )
    await broker.start()
    try:
        await broker.services.routes.declare(LEDGER, partitions=2, on_dead="skip")

        async def produce(*names: str) -> None:
            results = await broker.services.producer.produce(
                [incoming(n, created[n]) for n in names]
            )
            assert {r["status"] for r in results} == {"stored"}

        await produce("a1", "a3")
        await produce("a2")
        await produce("b1", "b2")
        await produce("c2")
        await produce("plain")
        routes = broker.services.routes.document(LEDGER)
        logic = logic_partition(KEYS["c"])
        (closed,) = [r for r in routes["ranges"] if r["lo"] <= logic < r["hi"]]
        at = logic if logic > closed["lo"] else logic + 1  # c moves to the upper half
        await broker.services.routes.split(LEDGER, partition=closed["partition"], at=at)
        await produce("c1")
        await produce("b3")
        assert (await consume(broker))[0] == len(OUTBOX_ORDER)
        got, acked_early = await consume(broker, SLOPPY)
        assert got == len(OUTBOX_ORDER)
    finally:
        await broker.close()
    return int(closed["partition"]), acked_early


@pytest.fixture(scope="module")
def world(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("ordered")
    old = datetime.now(UTC) - timedelta(hours=1)
    names = [*OUTBOX_ORDER, "plain"]
    created = {name: old + timedelta(milliseconds=n) for n, name in enumerate(names)}
    with fresh_database(pg_admin_url, prefix="qmq_reconcile_ordered") as url:
        rows = []
        for name in names:  # inserted one by one: outbox ids follow this order
            placed = row(
                name,
                "sent",
                producer=PRODUCER,
                subject=AUDIT if name == "plain" else LEDGER,
                created=created[name],
            )
            rows.append({**placed, "key": None if name == "plain" else KEYS[name[0]]})
        for one in rows:
            insert(url, [one])
        closed, acked_early = asyncio.run(write_broker(root / "broker", created))
        yield World(outbox=url, broker_dir=root / "broker", closed=closed, acked_early=acked_early)


def test_an_ordered_subject_is_reconciled_by_subject(
    world: World, tmp_path: Path, spark: SparkSession
) -> None:
    stored = read_broker(spark, [str(world.broker_dir)], "messages").collect()
    commands = [r for r in stored if r["command"]]
    assert [(r["id"], r["producer"], r["partition"]) for r in commands] == [
        (command_id(SPLIT_VERSION, world.closed), COMMAND_PRODUCER, world.closed)
    ]
    out = tmp_path / "out"
    # The command's producer is listed on purpose: even then it is no orphan.
    summary = reconcile(
        outboxes=[world.outbox],
        broker_dirs=[str(world.broker_dir)],
        out=out,
        producers=[PRODUCER, COMMAND_PRODUCER],
        spark=spark,
    )
    assert summary["categories"] == {**{c: 0 for c in CATEGORIES}, "delivered": 9}
    assert summary["exit_code"] == 0
    delivered = spark.read.parquet(str(out / "delivered")).collect()
    assert sorted({r["subject"] for r in delivered}) == [AUDIT, LEDGER]

    disorder = summary["out_of_order"]
    assert (disorder["count"], disorder["keys"]) == (2, 2)
    found = {m["message_id"]: m for m in disorder["messages"]}
    assert sorted(found) == ["a2", "c1"]
    assert (found["a2"]["after_id"], found["c1"]["after_id"]) == ("a3", "c2")
    assert found["a2"]["partition"] == logic_partition(KEYS["a"]) * 2 // 1024  # version 1
    assert found["c1"]["partition"] not in (None, world.closed)  # moved by the split
    assert {m["subject"] for m in found.values()} == {LEDGER}
    written = spark.read.parquet(str(out / "out_of_order")).collect()
    assert sorted(r["message_id"] for r in written) == ["a2", "c1"]

    # The group's partitions are summed under the subject; the command it consumed is not
    # one of its acks, nor a latency sample.
    consumed = {
        "mode": "ordered",
        "acked": len(OUTBOX_ORDER),
        "unacked_past_threshold": 0,
        "dead_letters": 0,
        "never_acked": False,
    }
    assert summary["groups"] == {LEDGER: {GROUP: consumed, SLOPPY: consumed}}
    assert summary["latency_ms"]["created_to_stored"]["count"] == 9
    assert summary["latency_ms"]["stored_to_acked"]["count"] == 2 * len(OUTBOX_ORDER)

    # Group billing acked each batch in one request: in order. Group replay did not.
    assert "a2" in world.acked_early  # a1, a3, a2 are stored in one partition, in one batch
    acked = disorder["acked"]
    assert acked["count"] == len(world.acked_early)
    early = {m["message_id"]: m for m in acked["messages"]}
    assert set(early) == world.acked_early
    assert {(m["subject"], m["group"]) for m in early.values()} == {(LEDGER, SLOPPY)}
    assert acked["keys"] == len({m["key"] for m in early.values()})
    assert early["a2"]["earlier_id"] == "a1"  # of a1 and a3, stored ahead, a1 was acked last
    assert early["a2"]["acked_at"] < early["a2"]["earlier_acked_at"]
    written = spark.read.parquet(str(out / "out_of_order_acked")).collect()
    assert {r["message_id"] for r in written} == world.acked_early

    text = (out / "report.txt").read_text()
    assert f"{LEDGER}/{GROUP}" in text
    assert f"{LEDGER}#" not in text
    assert f"{LEDGER} key {KEYS['a']}: a2 " in text
    assert f"{LEDGER} group {SLOPPY} key {KEYS['a']}: a2 " in text
    assert (
        f"2 message(s) stored out of order; {len(world.acked_early)} message(s) acked out "
        "of order -> exit 0"
    ) in text
    page = (out / "report.html").read_text()
    assert "<h2>Stored out of order</h2>" in page
    assert "<h2>Acked out of order</h2>" in page
    assert f"{LEDGER}#" not in page
    assert orjson.loads((out / "summary.json").read_bytes()) == summary
