"""The reconciliation end to end: real brokers, a PostgreSQL and a SQLite outbox, the CLI.

The crafted world plants every category on purpose across two outbox databases and two
broker data directories written by real broker processes over HTTP:

====================  ===========================================================  =====
category              planted                                                      count
====================  ===========================================================  =====
delivered             d1-d3 (PostgreSQL → broker A), s1-s2 (SQLite → broker B)          5
missing_in_broker     ``lost``: a sent row never produced                              1
stuck_pending         ``stuck``: an hour-old pending row never produced                1
pending_but_stored    ``pending-stored``: a pending row whose message is stored        1
dead_in_outbox        ``dead``: a dead row                                             1
orphan_in_broker      ``orphan-a`` (orders, broker A), ``orphan-b`` (billing, B)       2
body_mismatch         ``changed``: stored with another body than its row               1
duplicate_in_broker   ``twice``: stored in broker A and in broker B                    1
====================  ===========================================================  =====

Not judged: ``young`` (a pending row inside the grace period), ``foreign`` and ``sync``
(messages from producers that have no outbox here). Groups: ``orders.created/billing-svc`` acks
everything, ``orders.created/audit`` pulls but never acks, ``billing.charged/ledger``
acks one message and dead-letters another (broker B runs with ``--max-attempts 1``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from pyspark.sql import SparkSession

from qmq_outbox.client import BrokerClient
from qmq_reconcile import CATEGORIES, reconcile
from tests.spark.worlds import drain, insert, produce, row
from tests.support.broker_process import BrokerProcess
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.spark

ORDERS, BILLING = "orders.created", "billing.charged"
EXPECTED = {
    "delivered": 5,
    "missing_in_broker": 1,
    "stuck_pending": 1,
    "pending_but_stored": 1,
    "dead_in_outbox": 1,
    "orphan_in_broker": 2,
    "body_mismatch": 1,
    "duplicate_in_broker": 1,
}
CLI_TIMEOUT = 240


@dataclass
class World:
    outboxes: list[str]
    broker_dirs: list[str]
    root: Path


@pytest.fixture(scope="module")
def world(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("world")
    now = datetime.now(UTC)
    old, young = now - timedelta(hours=1), now - timedelta(minutes=1)
    broker_a = BrokerProcess(root / "broker-a")
    broker_b = BrokerProcess(root / "broker-b", extra_args=["--max-attempts", "1"])
    with fresh_database(pg_admin_url, prefix="qmq_reconcile") as pg_url:
        try:
            broker_a.start()
            broker_b.start()
            orders = {"producer": "orders", "subject": ORDERS, "created": old}
            billing = {"producer": "billing", "subject": BILLING, "created": old}
            insert(
                pg_url,
                [
                    *(row(n, "sent", **orders) for n in ("d1", "d2", "d3", "lost", "changed")),
                    row("twice", "sent", **orders),
                    row("stuck", "pending", **orders),
                    row("pending-stored", "pending", **orders),
                    row("dead", "dead", **orders),
                    row("young", "pending", producer="orders", subject=ORDERS, created=young),
                ],
            )
            sqlite_url = f"sqlite:///{root / 'billing.db'}"
            insert(sqlite_url, [row(n, "sent", **billing) for n in ("s1", "s2")])
            with BrokerClient(broker_a.url) as a, BrokerClient(broker_b.url) as b:
                stored_in_a = ["d1", "d2", "d3", "pending-stored", "twice", "orphan-a"]
                produce(a, stored_in_a, **orders)
                produce(a, ["changed"], **orders, version=2)
                produce(a, ["foreign"], subject=ORDERS, producer="inventory", created=old)
                produce(b, ["twice"], **orders)
                produce(b, ["s1", "s2", "orphan-b"], **billing)
                assert drain(a, ORDERS, "billing-svc", ack=True) == 8
                assert drain(a, ORDERS, "audit", ack=False) == 8
                (first,) = b.pull(BILLING, "ledger", "ledger-1", max_messages=1)
                assert b.nack(BILLING, "ledger", "ledger-1", [first.seq], error="boom")["dead"] == 1
                (second,) = b.pull(BILLING, "ledger", "ledger-1", max_messages=1)
                b.ack(BILLING, "ledger", "ledger-1", [second.seq])
                # Leases and acks are answered before they are fsynced; a produce is not,
                # and its commit covers every record appended before it.
                produce(b, ["sync"], subject="probe", producer="probe", created=old)
            assert broker_a.terminate() == 0  # graceful: flushes and checkpoints
            broker_b.kill9()  # the reader copes with whatever a killed broker left
        finally:
            broker_a.stop()
            broker_b.stop()
        yield World(
            outboxes=[pg_url, sqlite_url],
            broker_dirs=[str(broker_a.data_dir), str(broker_b.data_dir)],
            root=root,
        )


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QMQ_")}
    return subprocess.run(
        [sys.executable, "-m", "qmq_outbox", "reconcile", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        env=env,
    )


def world_args(world: World, out: Path) -> list[str]:
    args = [f"--outbox={u}" for u in world.outboxes]
    args += [f"--broker-data={d}" for d in world.broker_dirs]
    return [*args, f"--out={out}", "--master=local[2]", "--ack-threshold=0s"]


def test_crafted_world_every_count_exact_and_exit_1(
    world: World, tmp_path: Path, spark: SparkSession
) -> None:
    out = tmp_path / "out"
    done = cli(*world_args(world, out))
    assert done.returncode == 1, done.stderr
    # stderr (not a terminal here) has one line per stage and nothing else.
    stages = [
        re.fullmatch(r"reconcile: (.+) \.\.\. \d+\.\d s", line) for line in done.stderr.splitlines()
    ]
    assert all(stages), done.stderr
    assert {m.group(1) for m in stages if m} >= {
        "starting Spark (local[2])",
        "reading broker data",
        "reading outbox tables",
        "classifying messages",
        "counting consumer groups and latency",
        "writing the reports",
    }
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["categories"] == EXPECTED
    # Broker B was killed: a torn tail at the end of a log is not damage.
    assert summary["unreadable_in_broker"] == {"count": 0, "bytes": 0, "regions": []}
    assert summary["exit_code"] == 1
    groups = summary["groups"]
    assert groups[ORDERS]["billing-svc"] == {
        "mode": "shared",
        "acked": 8,
        "unacked_past_threshold": 0,
        "dead_letters": 0,
        "never_acked": False,
    }
    assert groups[ORDERS]["audit"]["never_acked"] is True
    assert groups[ORDERS]["audit"]["unacked_past_threshold"] == 8
    ledger = groups[BILLING]["ledger"]
    assert (ledger["acked"], ledger["dead_letters"], ledger["unacked_past_threshold"]) == (1, 1, 1)
    latency = summary["latency_ms"]
    assert latency["created_to_stored"]["count"] == 13  # 8 in A, 5 in B
    assert latency["stored_to_acked"]["count"] == 9
    assert 3_000_000 < latency["created_to_stored"]["p50"] < 4_000_000  # about an hour
    assert "result: 5 critical finding(s) -> exit 1" in done.stdout
    assert (out / "report.txt").read_text() in done.stdout
    page = (out / "report.html").read_text()
    assert "never acked" in page
    assert "Latency histogram" in page
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(CATEGORIES)
    ids = {
        name: sorted(r["message_id"] for r in spark.read.parquet(str(out / name)).collect())
        for name in CATEGORIES
    }
    assert ids == {
        "delivered": ["d1", "d2", "d3", "s1", "s2"],
        "missing_in_broker": ["lost"],
        "stuck_pending": ["stuck"],
        "pending_but_stored": ["pending-stored"],
        "dead_in_outbox": ["dead"],
        "orphan_in_broker": ["orphan-a", "orphan-b"],
        "body_mismatch": ["changed"],
        "duplicate_in_broker": ["twice"],
    }


def test_python_api_with_explicit_producers(
    world: World, tmp_path: Path, spark: SparkSession
) -> None:
    summary = reconcile(
        outboxes=world.outboxes,
        broker_dirs=world.broker_dirs,
        out=tmp_path / "out",
        producers=["orders", "inventory"],
        spark=spark,
    )
    # billing's orphan is no longer judged; inventory's message now needs a row.
    assert summary["categories"] == {**EXPECTED, "orphan_in_broker": 2}
    orphans = spark.read.parquet(str(tmp_path / "out" / "orphan_in_broker")).collect()
    assert sorted(r["message_id"] for r in orphans) == ["foreign", "orphan-a"]
    until_summary = reconcile(
        outboxes=world.outboxes,
        broker_dirs=world.broker_dirs,
        out=tmp_path / "out",
        until=datetime.now(UTC) - timedelta(hours=2),
        spark=spark,
    )
    assert set(until_summary["categories"].values()) == {0}
    assert until_summary["exit_code"] == 0
    assert not (tmp_path / "out" / "delivered").exists()  # stale folders are removed


def test_clean_world_exit_0_while_the_broker_runs(pg_admin_url: str, tmp_path: Path) -> None:
    created = datetime.now(UTC) - timedelta(minutes=30)
    names = ["c1", "c2", "c3"]
    db = f"sqlite:///{tmp_path / 'clean.db'}"
    insert(db, [row(n, "sent", producer="clean", subject=ORDERS, created=created) for n in names])
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        with BrokerClient(broker.url) as client:
            produce(client, names, subject=ORDERS, producer="clean", created=created)
            assert drain(client, ORDERS, "g", ack=True) == 3
        out = tmp_path / "out"
        args = [f"--outbox={db}", f"--broker-data={broker.data_dir}", f"--out={out}"]
        done = cli(*args, "--master=local[2]")
    finally:
        broker.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["categories"] == {name: 3 if name == "delivered" else 0 for name in CATEGORIES}
    assert summary["unreadable_in_broker"]["count"] == 0  # read while the broker writes
    assert summary["groups"][ORDERS]["g"]["acked"] == 3
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["delivered"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "No such option"),
        (["--broker-data=/nonexistent", "--out=OUT"], "Missing option '--outbox'"),
        (["--outbox=sqlite:///DB", "--broker-data=/nonexistent", "--out=OUT"], "/nonexistent"),
        (["--outbox=nonsense", "--broker-data=BROKER", "--out=OUT"], "not a database URL"),
        (["--outbox=mysql://u@h/db", "--broker-data=BROKER", "--out=OUT"], "not supported"),
        (["--outbox=sqlite:////no/such.db", "--broker-data=BROKER", "--out=OUT"], "/no/such.db"),
        (["--outbox=sqlite:///DB", "--broker-data=BROKER", "--out=OUT", "--grace=5x"], "5x"),
        (["--outbox=sqlite:///DB", "--broker-data=DB", "--out=OUT"], "not a directory"),
    ],
)
def test_bad_input_exit_2_with_one_line(
    args: list[str], message: str, world: World, tmp_path: Path
) -> None:
    sqlite_db = world.outboxes[1].removeprefix("sqlite:///")
    replace = {"DB": sqlite_db, "BROKER": world.broker_dirs[0], "OUT": str(tmp_path / "o")}
    for key, value in replace.items():
        args = [a.replace(f"={key}", f"={value}").replace(f"///{key}", f"///{value}") for a in args]
    done = cli(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0]
    assert done.stdout == ""
