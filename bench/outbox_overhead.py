"""Outbox overhead on PostgreSQL, with a real broker process (`qmq broker`) on a temp dir.

    .venv/bin/python bench/outbox_overhead.py [--admin-url URL] [--quick]

1. Caller cost: a transaction inserting one business row, with and without ``publish()``,
   interleaved in one run (random order per pair); median and p99 ratio.
2. Commit -> stored latency at 500 transactions/s offered (open loop, paced by a clock):
   commit time = wall clock in ``after_commit`` (the database's COMMIT has returned, the
   outbox has not handed the message over yet); stored time = the broker's
   ``stored_at`` (when it appended the message, before the fsync that precedes its answer),
   read back with a pull; also commit -> ``sent_at`` (the dispatcher heard the durable
   answer and marked the row).
3. Compensator drain: 100,000 pending rows bulk-inserted, drained by one ``Compensator``
   (batches of 1000) and by two in threads; rows/s.

Prints a markdown block. Creates a fresh database on the server and drops it afterwards.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._database import fresh_database
from qmq_outbox import migrate
from qmq_outbox.client import BrokerClient
from qmq_outbox.compensator import Compensator
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import outbox_table
from qmq_outbox.store import OutboxStore

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "bench_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]
    amount: Mapped[int]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@contextmanager
def broker_process() -> Iterator[str]:
    data = Path(tempfile.mkdtemp(prefix="qmq-bench-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "qmq_outbox", "broker", "--data-dir", str(data / "d")]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    log = open(data / "broker.log", "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((data / "broker.log").read_text()[-2000:])
            time.sleep(0.05)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


def wait_all_sent(engine: sa.Engine, timeout: float = 120.0) -> None:
    stmt = sa.select(sa.func.count()).where(outbox_table.c.status == "pending")
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            if conn.execute(stmt).scalar_one() == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError("rows still pending")
        time.sleep(0.05)


# -- 1. caller overhead -------------------------------------------------------------------------


def caller_overhead(maker: sessionmaker[Session], outbox: Outbox, pairs: int) -> dict[str, float]:
    def one(publish: bool) -> float:
        started = time.perf_counter()
        with maker.begin() as session:
            session.add(Order(customer="c", amount=42))
            if publish:
                outbox.publish(session, "bench.order", {"customer": "c", "amount": 42})
        return time.perf_counter() - started

    for _ in range(200):  # warm up pools, caches, the dispatcher thread
        one(True)
        one(False)
    plain: list[float] = []
    with_publish: list[float] = []
    for _ in range(pairs):
        order = [True, False]
        random.shuffle(order)
        for flag in order:
            (with_publish if flag else plain).append(one(flag))
    return {
        "plain_p50": statistics.median(plain) * 1e3,
        "plain_p99": percentile(plain, 0.99) * 1e3,
        "pub_p50": statistics.median(with_publish) * 1e3,
        "pub_p99": percentile(with_publish, 0.99) * 1e3,
    }


# -- 2. commit -> stored latency ------------------------------------------------------------------


def commit_to_stored(
    maker: sessionmaker[Session],
    outbox: Outbox,
    engine: sa.Engine,
    broker_url: str,
    seconds: float,
    threads: int = 8,
) -> dict[str, float]:
    """Open loop: transaction i starts at start + i/rate on one of ``threads`` threads (a
    PostgreSQL commit waits for its WAL flush, so one thread cannot offer 500/s)."""
    subject = f"bench.latency.{uuid.uuid4().hex[:6]}"
    rate = 500.0
    committed: dict[str, float] = {}
    count = int(rate * seconds)
    start = time.perf_counter() + 0.1
    slots = iter(range(count))
    lock = threading.Lock()
    late = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next(slots, None)
            if i is None:
                return
            pause = start + i / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            elif pause < -0.002:
                late[0] += 1
            with maker.begin() as session:
                session.add(Order(customer="l", amount=i))
                message_id = outbox.publish(session, subject, {"i": i})
            committed[message_id] = session.info["committed_at"]

    def stamp(session: Session) -> None:  # COMMIT has returned; the hand-off comes next
        session.info["committed_at"] = time.time()

    sa.event.listen(maker, "after_commit", stamp)
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    sa.event.remove(maker, "after_commit", stamp)
    lag = late[0]
    elapsed = time.perf_counter() - start
    wait_all_sent(engine)
    stored: dict[str, float] = {}
    with BrokerClient(broker_url) as client:
        while True:
            batch = client.pull(subject, "bench-latency", "c", max_messages=1000)
            if not batch:
                break
            stored.update({m.id: m.stored_at.timestamp() for m in batch if m.stored_at})
    with engine.connect() as conn:
        sent_rows = conn.execute(
            sa.select(outbox_table.c.message_id, outbox_table.c.sent_at).where(
                outbox_table.c.subject == subject
            )
        ).all()
    sent = {r.message_id: r.sent_at.timestamp() for r in sent_rows}
    to_stored = [(stored[m] - t) * 1e3 for m, t in committed.items() if m in stored]
    to_sent = [(sent[m] - t) * 1e3 for m, t in committed.items() if m in sent]
    return {
        "offered_rate": rate,
        "achieved_rate": count / elapsed,
        "late_starts": lag,
        "count": len(to_stored),
        "stored_p50": statistics.median(to_stored),
        "stored_p99": percentile(to_stored, 0.99),
        "sent_p50": statistics.median(to_sent),
        "sent_p99": percentile(to_sent, 0.99),
    }


# -- 3. compensator drain -------------------------------------------------------------------------


def bulk_pending(engine: sa.Engine, rows: int, subject: str) -> None:
    created = datetime.now(UTC) - timedelta(minutes=5)
    chunk = 10_000
    tag = uuid.uuid4().hex[:8]
    with engine.begin() as conn:
        for offset in range(0, rows, chunk):
            conn.execute(
                sa.insert(outbox_table),
                [
                    {
                        "message_id": f"{tag}-{i}",
                        "subject": subject,
                        "headers": {},
                        "body": b'{"order_id": %d, "amount": 42}' % i,
                        "content_type": "application/json",
                        "producer": "bench",
                        "status": "pending",
                        "attempts": 0,
                        "next_attempt_at": created,
                        "created_at": created,
                    }
                    for i in range(offset, min(rows, offset + chunk))
                ],
            )
    with engine.begin() as conn:
        conn.execute(sa.text("ANALYZE qmq_outbox"))


def drain(engine: sa.Engine, broker_url: str, rows: int, workers: int) -> dict[str, float]:
    subject = f"bench.drain.{uuid.uuid4().hex[:6]}"
    bulk_pending(engine, rows, subject)
    compensators = [
        Compensator(
            store=OutboxStore(engine),
            client=BrokerClient(broker_url, timeout=60),
            grace=timedelta(0),
            batch_size=1000,
        )
        for _ in range(workers)
    ]

    def run(worker: Compensator) -> None:
        while worker.run_once().claimed:
            pass

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in compensators]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    with engine.connect() as conn:
        left = conn.execute(
            sa.select(sa.func.count()).where(
                outbox_table.c.subject == subject, outbox_table.c.status != "sent"
            )
        ).scalar_one()
    with BrokerClient(broker_url) as client:
        stored = int(client.subject(subject)["messages"])
    for c in compensators:
        c.stop(5)
        c.client.close()
    return {
        "workers": workers,
        "rows": rows,
        "seconds": elapsed,
        "rate": rows / elapsed,
        "left": left,
        "stored": stored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--admin-url", default=os.environ.get("QMQ_BENCH_DATABASE_URL", ADMIN_URL))
    parser.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    args = parser.parse_args()
    pairs = 300 if args.quick else 3000
    seconds = 2.0 if args.quick else 10.0
    drain_rows = 10_000 if args.quick else 100_000
    load = os.getloadavg()
    with fresh_database(args.admin_url, prefix="qmq_bench") as url, broker_process() as broker_url:
        migrate.upgrade(url)
        engine = sa.create_engine(url, pool_size=8)
        Base.metadata.create_all(engine)
        maker = sessionmaker(engine)
        outbox = Outbox(broker_url=broker_url, app="bench")
        outbox.install(maker)
        overhead = caller_overhead(maker, outbox, pairs)
        wait_all_sent(engine)
        latency = commit_to_stored(maker, outbox, engine, broker_url, seconds)
        outbox.close()
        drains = [
            drain(engine, broker_url, drain_rows, 1),
            drain(engine, broker_url, drain_rows, 2),
        ]
        engine.dispose()
    report(overhead, latency, drains, (*load, os.getloadavg()[0]), pairs)


def report(
    overhead: dict[str, float],
    latency: dict[str, float],
    drains: list[dict[str, float]],
    load: tuple[float, float, float, float],
    pairs: int,
) -> None:
    o = overhead
    median_ratio = o["pub_p50"] / o["plain_p50"]
    p99_ratio = o["pub_p99"] / o["plain_p99"]
    lines = [
        f"- machine: {os.cpu_count()} vCPU, {platform.python_implementation()} "
        f"{platform.python_version()}, load average (1/5/15 min) before the run "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}, after it {load[3]:.2f}",
        "",
        f"1. Caller's transaction (1 business row), {pairs} interleaved pairs:",
        "",
        "| | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| without publish | {o['plain_p50']:.3f} | {o['plain_p99']:.3f} |",
        f"| with publish | {o['pub_p50']:.3f} | {o['pub_p99']:.3f} |",
        f"| ratio (target ≤ 1.25 / ≤ 1.5) | {median_ratio:.2f}x | {p99_ratio:.2f}x |",
        "",
        f"2. Commit → stored at {latency['offered_rate']:.0f} tx/s offered "
        f"(achieved {latency['achieved_rate']:.0f} tx/s, {latency['late_starts']:.0f} started "
        f">2 ms late, {latency['count']:.0f} messages):",
        "",
        "| | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| commit → broker stored_at (target ≤ 5 / ≤ 25) | {latency['stored_p50']:.2f} "
        f"| {latency['stored_p99']:.2f} |",
        f"| commit → row marked sent (durable ack) | {latency['sent_p50']:.2f} "
        f"| {latency['sent_p99']:.2f} |",
        "",
        "3. Compensator drain of pending rows (target ≥ 10,000 rows/s):",
        "",
        "| compensators | rows | seconds | rows/s | left pending | stored in broker |",
        "|---|---|---|---|---|---|",
    ]
    for d in drains:
        lines.append(
            f"| {d['workers']:.0f} | {d['rows']:.0f} | {d['seconds']:.2f} | {d['rate']:.0f} "
            f"| {d['left']:.0f} | {d['stored']:.0f} |"
        )
    print("```markdown")
    print("\n".join(lines))
    print("```")


if __name__ == "__main__":
    main()
