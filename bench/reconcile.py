"""Reconciliation end to end: N outbox rows against N broker records (1,000,000 by default).

    .venv/bin/python bench/reconcile.py [--rows 1000000] [--master local[2]] [--runs 1]
        [--admin-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres] [--keep]
        [--settle-below 1.0]
    .venv/bin/python bench/reconcile.py --rows 1000        # the small run: fixed costs

Set-up (not part of the timed run):
1. a fresh PostgreSQL database with a ``qmq_outbox`` table (``qmq_outbox.schema``),
   bulk-loaded with ``COPY``, then vacuumed and checkpointed (as a service's table would
   be; otherwise the first timed run's scan writes every page of it back);
2. a broker data directory written in-process by the broker's own engine and storage code
   (``qmq_broker.engine.Broker``: journal, segments, subject index, action log), over 4
   subjects; one shared group pulls and acks every message (lease + ack records).
Planted: 100 pending rows whose message is stored, 100 sent rows never stored, 100 broker
messages without a row (fewer when ``--rows`` is small); everything else is delivered.

Timed: ``qmq reconcile`` as a user runs it, in a subprocess on ``--master``, from the
process's start to its exit (Python and JVM start-up, the stages, the JVM's exit), with
its stage lines (its stderr is a pipe: one plain line per stage; two threads run the
stages, read broker then groups and read outbox then classify, so their times overlap) and the CPU
seconds of its process tree. The 1-minute load average is printed before each run: the
figures only mean something when it is low.

The first run with a given Java and Spark writes the JVM's class-data archive
(``qmq_reconcile.jvm_archive``), which costs seconds once; when there is none yet, one
unmeasured warm-up run writes it first.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson
import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench._speed import python_speed
from qmq_broker.clock import SystemClock
from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.engine import Broker
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics
from qmq_outbox.schema import metadata, outbox_table
from tests.support.postgres import fresh_database

SUBJECTS = [f"orders.s{n}" for n in range(4)]
PRODUCER = "orders"
PLANTED_MAX = 100
BATCH = 1000
COPY_COLUMNS = (
    "message_id, subject, headers, body, content_type, producer, status, "
    "next_attempt_at, created_at, sent_at"
)


def body(n: int) -> bytes:
    return orjson.dumps({"order_id": n, "amount_cents": n % 100_000, "note": "x" * 64})


def subject_of(n: int) -> str:
    return SUBJECTS[n % len(SUBJECTS)]


def planted(rows: int) -> int:
    """How many of each planted finding: 100, or a tenth of the rows when they are few."""
    return min(PLANTED_MAX, rows // 10)


def row_status(n: int, rows: int) -> str:
    return "pending" if n < planted(rows) else "sent"


def stored(n: int, rows: int) -> bool:
    return n < rows - planted(rows)  # the last rows were "sent" but never stored: lost


def load_outbox(url: str, rows: int, created: datetime) -> float:
    began = time.perf_counter()
    engine = sa.create_engine(url)
    metadata.create_all(engine, tables=[outbox_table])
    engine.dispose()
    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    copy_sql = f"COPY qmq_outbox ({COPY_COLUMNS}) FROM STDIN"
    with psycopg.connect(libpq) as conn, conn.cursor() as cur, cur.copy(copy_sql) as copy:
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
    # A service's outbox table is not freshly bulk-loaded: vacuumed, its rows' hint bits
    # are set and the pages written back now, not by the first timed run's scan (which
    # would rewrite every page of the table, work no later run has).
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) qmq_outbox")
        conn.execute("CHECKPOINT")
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
    ids += [(f"orphan-{n}", rows + n) for n in range(planted(rows))]
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        batch = [incoming(i, n, created_us(created, n)) for i, n in chunk]
        clock.now_us = max(clock.now_us, batch[-1].created_at_us or 0) + 2_000 + start % 7_000
        await broker.services.producer.produce(batch)
    for subject in SUBJECTS:
        while True:
            pulled, _ = await broker.services.delivery.ack_and_pull(
                ack=None,
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
            await broker.services.delivery.ack(
                subject=subject, group="billing", consumer="c1", seqs=seqs
            )
    await broker.close()
    return time.perf_counter() - began


def process_tree(root: int) -> dict[int, float]:
    """CPU seconds used so far by ``root`` and every live descendant, per pid."""
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
    used: dict[int, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            used[pid] = sum(int(f) for f in stats[pid][11:15]) / tick
        todo.extend(children.get(pid, []))
    return used


def du_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def load_average() -> str:
    return Path("/proc/loadavg").read_text().strip()


@dataclasses.dataclass(frozen=True)
class CliRun:
    seconds: float
    cpu_seconds: float
    exit_code: int
    stages: list[tuple[str, str]]  # (label, "3.1 s"), in the order they ended
    summary: dict[str, Any]
    stderr: str


STAGE_LINE = re.compile(r"reconcile: (?P<label>.+) \.\.\. (?P<time>.+)")


def run_cli(url: str, data_dir: Path, out: Path, master: str) -> CliRun:
    """``qmq reconcile`` in a subprocess; its CPU is sampled every 0.1 s (the JVM outlives
    the Python process by a moment and is not this process's child to reap)."""
    command = [
        sys.executable, "-m", "qmq_outbox", "reconcile", "--outbox", url,
        "--broker-data", str(data_dir), "--out", str(out), "--master", master, "--grace", "0s",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("QMQ_")}
    used: dict[int, float] = {}
    began = time.perf_counter()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        sampled = threading.Event()

        def sample() -> None:
            while not sampled.wait(0.1):
                used.update(process_tree(proc.pid))

        sampler = threading.Thread(target=sample, name="bench-cpu")
        sampler.start()
        stdout, stderr = proc.communicate()  # returns once the JVM closed the pipes too
        seconds = time.perf_counter() - began
        sampled.set()
        sampler.join()
    stages = [(m["label"], m["time"]) for m in map(STAGE_LINE.fullmatch, stderr.splitlines()) if m]
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise SystemExit(f"qmq reconcile failed (exit {proc.returncode}):\n{stdout}{stderr}")
    summary = orjson.loads(summary_path.read_bytes())
    return CliRun(seconds, sum(used.values()), proc.returncode, stages, summary, stderr)


def report(run: CliRun, rows: int) -> None:
    print(f"qmq reconcile end to end: {run.seconds:.1f} s (exit {run.exit_code}), "
          f"CPU of its process tree {run.cpu_seconds:.0f} s")  # fmt: skip
    for label, took in run.stages:
        print(f"  {label:<40} {took}")
    expected = {
        "delivered": rows - 2 * planted(rows),
        "pending_but_stored": planted(rows),
        "missing_in_broker": planted(rows),
        "orphan_in_broker": planted(rows),
    }
    got = {k: v for k, v in run.summary["categories"].items() if v}
    print(f"  counts as planted: {got == expected}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--runs", type=int, default=1, help="timed runs of qmq reconcile")
    parser.add_argument(
        "--admin-url",
        default=os.environ.get(
            "QMQ_BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    parser.add_argument(
        "--settle-below",
        type=float,
        default=None,
        metavar="LOAD",
        help="before each timed run, wait until the 1-minute load average is below LOAD "
        "(the set-up and the run before leave the box busy)",
    )
    args = parser.parse_args()

    from qmq_reconcile.session import class_archive, default_jvm_cache

    work = Path(tempfile.mkdtemp(prefix="qmq-bench-reconcile-"))
    created = datetime.now(UTC) - timedelta(hours=1)
    print(f"rows={args.rows:,} master={args.master} work={work}", flush=True)
    try:
        with fresh_database(args.admin_url, prefix="qmq_bench_reconcile") as url:
            copy_s = load_outbox(url, args.rows, created)
            print(f"setup: COPY {args.rows:,} outbox rows in {copy_s:.1f}s", flush=True)
            data_dir = work / "broker"
            broker_s = asyncio.run(write_broker(data_dir, args.rows, created))
            os.sync()  # the set-up's writes reach the disk before the first timed run
            print(
                f"setup: broker engine wrote {args.rows:,} messages + lease/ack records "
                f"in {broker_s:.1f}s ({du_mb(data_dir):.0f} MiB)",
                flush=True,
            )
            cache = default_jvm_cache()
            archive = class_archive(cache) if cache is not None else None
            if archive is not None and archive.writing is not None:
                print("warm-up (writes the JVM class archive, not measured)", flush=True)
                run_cli(url, data_dir, work / "out-warm-up", args.master)
            for number in range(1, args.runs + 1):
                while args.settle_below is not None and os.getloadavg()[0] >= args.settle_below:
                    time.sleep(5)
                print(
                    f"run {number}: load average at start: {load_average()}; {python_speed()}",
                    flush=True,
                )
                report(run_cli(url, data_dir, work / f"out-{number}", args.master), args.rows)
            print(f"load average at the end: {load_average()}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()} {cores} vCPU, Python {platform.python_version()}")
    print(f"date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}")


if __name__ == "__main__":
    main()
