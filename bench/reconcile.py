"""Reconciliation at scale: 1,000,000 outbox rows against 1,000,000 broker records.

    .venv/bin/python bench/reconcile.py [--rows 1000000] [--master local[2]]
        [--admin-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres] [--keep]

Set-up (not part of the timed run):
1. a fresh PostgreSQL database with a ``qmq_outbox`` table (``qmq_outbox.schema``),
   bulk-loaded with ``COPY``;
2. a broker data directory written in-process by the broker's own engine and storage code
   (``broker.engine.Broker``: journal, segments, subject index, action log), over 4
   subjects; one shared group pulls and acks every message (lease + ack records).
Planted: 100 pending rows whose message is stored, 100 sent rows never stored, 100 broker
messages without a row; everything else is delivered.

Timed: ``spark_reconcile.run`` end to end on ``--master`` (session start, read broker,
read outbox, classify, write outputs, session stop), with the time split by stage.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson
import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from broker.clock import SystemClock
from broker.config import BrokerConfig, FsyncPolicy
from broker.engine import Broker
from broker.messages import IncomingMessage
from broker.metrics import BrokerMetrics
from qmq_outbox.schema import metadata, outbox_table
from tests.support.postgres import fresh_database

SUBJECTS = [f"orders.s{n}" for n in range(4)]
PRODUCER = "orders"
PLANTED = 100
BATCH = 1000
COPY_COLUMNS = (
    "message_id, subject, headers, body, content_type, producer, status, "
    "next_attempt_at, created_at, sent_at"
)


def body(n: int) -> bytes:
    return orjson.dumps({"order_id": n, "amount_cents": n % 100_000, "note": "x" * 64})


def subject_of(n: int) -> str:
    return SUBJECTS[n % len(SUBJECTS)]


def row_status(n: int, rows: int) -> str:
    return "pending" if n < PLANTED else "sent"


def stored(n: int, rows: int) -> bool:
    return n < rows - PLANTED  # the last rows were "sent" but never stored: lost


def load_outbox(url: str, rows: int, created: datetime) -> float:
    began = time.perf_counter()
    engine = sa.create_engine(url)
    metadata.create_all(engine, tables=[outbox_table])
    engine.dispose()
    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq) as conn, conn.cursor() as cur:
        with cur.copy(f"COPY qmq_outbox ({COPY_COLUMNS}) FROM STDIN") as copy:
            for n in range(rows):
                status = row_status(n, rows)
                at = created + timedelta(microseconds=n * 50)
                copy.write_row(
                    (
                        f"bench-{n:07d}",
                        subject_of(n),
                        "{}",
                        body(n),
                        "application/json",
                        PRODUCER,
                        status,
                        at,
                        at,
                        at if status == "sent" else None,
                    )
                )
        cur.execute("ANALYZE qmq_outbox")
    return time.perf_counter() - began


def created_us(created: datetime, n: int) -> int:
    """Message ``n`` is created 50 µs after message ``n - 1`` (20,000 messages a second)."""
    return int(created.timestamp() * 1_000_000) + n * 50


def incoming(message_id: str, n: int, created_us: int) -> IncomingMessage:
    return IncomingMessage(
        id=message_id,
        subject=subject_of(n),
        key=None,
        headers={},
        body=body(n),
        body_base64=False,
        producer=PRODUCER,
        created_at_us=created_us,
        deliver_at_us=0,
    )


class SimulatedClock(SystemClock):
    """The broker's wall clock, set by the load: stored a few ms after created, acked later."""

    def __init__(self, now_us: int) -> None:
        self.now_us = now_us

    def wall_us(self) -> int:
        self.now_us += 1  # strictly increasing, like time passing
        return self.now_us


async def write_broker(data_dir: Path, rows: int, created: datetime) -> float:
    began = time.perf_counter()
    base = created_us(created, 0)
    clock = SimulatedClock(base)
    broker = Broker(
        BrokerConfig(data_dir=data_dir, fsync=FsyncPolicy(mode="never")),
        metrics=BrokerMetrics(),
        clock=clock,
    )
    await broker.start()
    ids = [(f"bench-{n:07d}", n) for n in range(rows) if stored(n, rows)]
    ids += [(f"orphan-{n}", rows + n) for n in range(PLANTED)]
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        batch = [incoming(i, n, created_us(created, n)) for i, n in chunk]
        clock.now_us = max(clock.now_us, batch[-1].created_at_us or 0) + 2_000 + start % 7_000
        await broker.producer.produce(batch)
    for subject in SUBJECTS:
        while True:
            pulled = await broker.delivery.pull(
                subject=subject,
                group="billing",
                consumer="c1",
                max_messages=BATCH,
                wait_ms=0,
                mode="shared",
                start="earliest",
            )
            if not pulled:
                break
            seqs = [m["seq"] for m in pulled]
            # acked about 200 ms after the batch's last message was stored
            last = datetime.fromisoformat(pulled[-1]["stored_at"].replace("Z", "+00:00"))
            clock.now_us = int(last.timestamp() * 1_000_000) + 200_000
            await broker.delivery.ack(subject=subject, group="billing", consumer="c1", seqs=seqs)
    await broker.close()
    return time.perf_counter() - began


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process's descendants (the JVM, Python workers),
    reaped ones included: how much machine the reconciliation needed, whatever else ran."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        fields = stats[pid]
        total += sum(int(f) for f in fields[11:15]) / tick
        todo.extend(children.get(pid, []))
    return total


def du_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--admin-url",
        default=os.environ.get(
            "QMQ_BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args()

    from spark_reconcile import run

    work = Path(tempfile.mkdtemp(prefix="qmq-bench-reconcile-"))
    created = datetime.now(UTC) - timedelta(hours=1)
    print(f"rows={args.rows:,} master={args.master} work={work}", flush=True)
    try:
        with fresh_database(args.admin_url, prefix="qmq_bench_reconcile") as url:
            copy_s = load_outbox(url, args.rows, created)
            print(f"setup: COPY {args.rows:,} outbox rows in {copy_s:.1f}s", flush=True)
            data_dir = work / "broker"
            broker_s = asyncio.run(write_broker(data_dir, args.rows, created))
            print(
                f"setup: broker engine wrote {args.rows:,} messages + lease/ack records "
                f"in {broker_s:.1f}s ({du_mb(data_dir):.0f} MiB)",
                flush=True,
            )
            load_before = os.getloadavg()[0]
            cpu_before = tree_cpu_seconds()
            began = time.perf_counter()
            result = run(
                outboxes=[url],
                broker_dirs=[str(data_dir)],
                out=work / "out",
                master=args.master,
                grace=timedelta(0),
                jvm_log=True,
            )
            total = time.perf_counter() - began
            cpu = tree_cpu_seconds() - cpu_before
            load_after = os.getloadavg()[0]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    stages = result.timings
    session = total - sum(stages.values())
    print(f"categories: {result.summary['categories']}")
    print(f"latency_ms: {result.summary['latency_ms']}")
    print(
        "reconcile end to end: "
        f"{total:.1f}s = session start/stop {session:.1f}s + "
        + " + ".join(f"{k} {v:.1f}s" for k, v in stages.items())
    )
    expected = {
        "delivered": args.rows - 2 * PLANTED,
        "pending_but_stored": PLANTED,
        "missing_in_broker": PLANTED,
        "orphan_in_broker": PLANTED,
    }
    got = {k: v for k, v in result.summary["categories"].items() if v}
    print(f"counts as planted: {got == expected}")
    print(
        f"CPU used by the run (JVM + Python workers): {cpu:.0f}s; "
        f"1-min load average before/after: {load_before:.1f}/{load_after:.1f}"
    )
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()} {cores} vCPU, Python {platform.python_version()}")
    print(f"date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}")


if __name__ == "__main__":
    main()
