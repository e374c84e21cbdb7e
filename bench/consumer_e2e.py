"""Consumer end to end: outbox commit -> broker -> consumer handler, on PostgreSQL.

    .venv/bin/python bench/consumer_e2e.py [--admin-url URL] [--seconds 15] [--quick]
        [--latency-only] [--rate 1000] [--publishers 1]

Starts its own broker (``python -m qmq_outbox broker``, fsync always) on a temp dir and a
fresh PostgreSQL database (dropped afterwards); the consumer runs in its own process.

1. Latency at 1,000 msgs/s offered: open loop, transaction i (one business row + one
   ``outbox.publish``) starts at ``t0 + i/1000`` on one of 16 producer threads. The
   publishing service runs in ``--publishers`` processes (the threads shared among them),
   as a service behind several workers would, so that one process's GIL need not cap the
   rate offered (its ORM transactions take about a millisecond of CPU each); on a 2-core
   box a second process only adds to what the cores carry. Commit
   time = wall clock in SQLAlchemy's ``after_commit`` (COMMIT returned; the outbox has not
   handed the message over yet). A message cannot carry a time that exists only once its
   transaction has committed, so the producer keeps it by message id and the consumer
   process sends back, by message id, the wall clock on entry to its handler (a consumer
   using ``IdempotentStore``: after the dedup insert; it bills the order in the same
   transaction) and the broker's ``stored_at``; same host, same clock. The first 2 s are
   warm-up and excluded.
2. Maximum throughput with the store: a backlog of N messages is produced first (straight
   to the broker), then one consumer process drains it, every message one PostgreSQL
   transaction (dedup row + business row); then with ``IdempotentStore(batch_size=32)``
   (one transaction for up to 32 queued messages), one process and two of the group.
   Rate = N / (time until the broker counts N acks - time the consumers were told to
   start; they are started and have imported everything before).
3. The same without the store (handler does nothing), one process.

Prints a markdown block for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._broker import BenchBroker
from bench._database import fresh_database
from qmq_outbox import BrokerClient, Consumer, IdempotentStore, Message
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import metadata

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
RATE = 1000.0
WARMUP = 2.0

business = sa.MetaData()
orders = sa.Table(
    "bench_orders",
    business,
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
)
invoices = sa.Table(
    "bench_invoices",
    business,
    sa.Column("message_id", sa.String(128), primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
)
INSERT_INVOICE = sa.insert(invoices)  # built once, executed with parameters


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- the consumer processes ---------------------------------------------------------------


def consumer_main(
    broker_url: str,
    db_url: str | None,
    subject: str,
    settings: dict[str, Any],
    ready: Any,
    go: Any,
    stop: Any,
    results: Any,
) -> None:
    """Consume until told to stop; send back the handler start times by message id."""
    starts: dict[str, tuple[float, float]] = {}  # id -> (handler start, broker stored_at)
    settings = dict(settings)
    batch_size = settings.pop("store_batch", 1)
    consumer = Consumer(broker_url, "bench", **settings)
    engine = None
    if db_url is None:

        def plain(message: Message) -> None:
            starts[message.id] = (time.time(), _stored(message))

        consumer.add_handler(subject, plain)
    else:
        engine = sa.create_engine(db_url, pool_size=settings["concurrency"] + 2)
        store = IdempotentStore(sessionmaker(engine), batch_size=batch_size)

        def bill(message: Message, session: Session) -> None:
            starts[message.id] = (time.time(), _stored(message))
            session.execute(INSERT_INVOICE, {"message_id": message.id, "amount": 1})

        consumer.add_handler(subject, bill, idempotent=store)
    runner = threading.Thread(
        target=consumer.run, kwargs={"install_signal_handlers": False}, name="bench-run"
    )
    ready.set()
    go.wait()
    cpu = time.process_time()
    runner.start()
    stop.wait()
    consumer.stop()
    runner.join(60)
    results.put((starts, consumer.stats(), time.process_time() - cpu))
    if engine is not None:
        engine.dispose()


def _stored(message: Message) -> float:
    return message.stored_at.timestamp() if message.stored_at else float("nan")


@contextmanager
def consumers(
    broker_url: str, db_url: str | None, subject: str, processes: int = 1, **settings: Any
) -> Iterator[tuple[Any, Any, list[Any]]]:
    """Start consumer processes (one group); yields (go, stop, results), collected on exit."""
    ctx = mp.get_context("spawn")
    go, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs, readies = [], []
    for n in range(processes):
        ready = ctx.Event()
        proc = ctx.Process(
            target=consumer_main,
            args=(broker_url, db_url, subject, settings, ready, go, stop, results),
            name=f"bench-consumer-{n}",
        )
        proc.start()
        procs.append(proc)
        readies.append(ready)
    for ready in readies:
        if not ready.wait(120):
            raise RuntimeError("consumer process did not start")
    collected: list[Any] = []
    try:
        yield go, stop, collected
    finally:
        stop.set()
        go.set()
        for _ in procs:
            collected.append(results.get(timeout=120))
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def acked(client: BrokerClient, subject: str) -> int:
    try:
        groups = client.subject(subject)["groups"]
    except Exception:
        return 0
    return sum(int(g["acked"]) for g in groups if g["group"] == "bench")


def wait_acked(client: BrokerClient, subject: str, count: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while acked(client, subject) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {acked(client, subject)} of {count} acked")
        time.sleep(0.005)
    return time.time()


# -- 1. latency ----------------------------------------------------------------------------


def publisher_main(
    broker_url: str,
    db_url: str,
    subject: str,
    slots: range,
    start: float,
    rate: float,
    threads: int,
    results: Any,
) -> None:
    """One process of the publishing service: ``threads`` threads commit the transactions of
    ``slots`` (transaction i at ``start + i / rate`` on the monotonic clock, which every
    process shares); sends back (commit time by message id, sends started late, when the
    last transaction had committed)."""
    engine = sa.create_engine(db_url, pool_size=threads + 2)
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker_url, app="bench")
    outbox.install(maker)

    @event.listens_for(maker, "after_commit")
    def committed(session: Session) -> None:
        session.info["committed_at"] = time.time()

    commits: dict[str, float] = {}
    todo = iter(slots)
    lock = threading.Lock()
    late = [0]

    def produce() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            pause = start + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            elif pause < -0.005:
                late[0] += 1
            with maker.begin() as session:
                session.execute(sa.insert(orders).values(id=i, amount=i))
                message_id = outbox.publish(session, subject, {"order": i})
            commits[message_id] = session.info["committed_at"]

    workers = [threading.Thread(target=produce, name=f"bench-producer-{n}") for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    finished = time.monotonic()
    outbox.close()
    engine.dispose()
    results.put((commits, late[0], finished))


def latency(
    broker_url: str,
    db_url: str,
    seconds: float,
    rate: float = RATE,
    threads: int = 16,
    publishers: int = 1,
) -> dict[str, float]:
    """Transaction i of ``rate * seconds`` on publisher process i % ``publishers``."""
    subject = f"bench.e2e.{uuid.uuid4().hex[:6]}"
    count = int(rate * seconds)
    settings: dict[str, Any] = {
        "concurrency": 8,
        "prefetch": 64,
        "wait_ms": 5000,
        "ack_interval": 0.05,
        "store_batch": 32,
    }
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with consumers(broker_url, db_url, subject, **settings) as (go, _, collected):
        go.set()
        time.sleep(1.0)  # let the consumer's first long poll reach the broker
        start = time.monotonic() + 3.0  # the publishers import and connect meanwhile
        procs = [
            ctx.Process(
                target=publisher_main,
                args=(
                    broker_url,
                    db_url,
                    subject,
                    range(n, count, publishers),
                    start,
                    rate,
                    max(1, threads // publishers),
                    results,
                ),
                name=f"bench-publisher-{n}",
            )
            for n in range(publishers)
        ]
        for proc in procs:
            proc.start()
        commits: dict[str, float] = {}
        late = 0
        finished = start
        for _ in procs:
            part, part_late, part_finished = results.get(timeout=seconds + 600)
            commits.update(part)
            late += part_late
            finished = max(finished, part_finished)
        offered_for = finished - start
        for proc in procs:
            proc.join(60)
        with BrokerClient(broker_url) as client:
            wait_acked(client, subject, count)
    starts = {k: v for result in collected for k, v in result[0].items()}
    consumer_cpu = sum(result[2] for result in collected)
    ordered = sorted(commits.items(), key=lambda item: item[1])
    skip = int(rate * WARMUP)
    joined = [(starts[mid], at) for mid, at in ordered[skip:] if mid in starts]
    delays = [(start - at) * 1000 for (start, _), at in joined]
    to_broker = [(stored - at) * 1000 for (_, stored), at in joined]
    to_handler = [(start - stored) * 1000 for (start, stored), _ in joined]
    return {
        "messages": float(len(delays)),
        "offered_rate": count / offered_for,
        "late_share": late / count,
        "p50": statistics.median(delays),
        "p90": percentile(delays, 0.90),
        "p99": percentile(delays, 0.99),
        "max": max(delays),
        "stored_p50": statistics.median(to_broker),
        "stored_p99": percentile(to_broker, 0.99),
        "handler_p50": statistics.median(to_handler),
        "handler_p99": percentile(to_handler, 0.99),
        "consumer_us": consumer_cpu / count * 1e6,
        "publishers": float(publishers),
    }


# -- 2./3. throughput ----------------------------------------------------------------------


def preload(broker_url: str, subject: str, count: int) -> None:
    with BrokerClient(broker_url) as client:
        for first in range(0, count, 1000):
            batch = [
                OutgoingMessage(id=f"{subject}-{n}", subject=subject, body=b'{"order": 1}')
                for n in range(first, min(count, first + 1000))
            ]
            client.produce(batch)


def drain(
    broker: BenchBroker, db_url: str | None, count: int, processes: int = 1, **settings: Any
) -> dict[str, float]:
    broker_url = broker.url
    subject = f"bench.drain.{uuid.uuid4().hex[:6]}"
    preload(broker_url, subject, count)
    with (
        BrokerClient(broker_url) as client,
        consumers(broker_url, db_url, subject, processes, **settings) as (go, _, collected),
    ):
        broker_cpu = broker.cpu_seconds()
        began = time.time()
        go.set()
        finished = wait_acked(client, subject, count)
        broker_cpu = broker.cpu_seconds() - broker_cpu
    processed = sum(stats.processed for _, stats, _ in collected)
    assert processed == count, collected
    consumer_cpu = sum(cpu for _, _, cpu in collected)
    return {
        "messages": float(count),
        "seconds": finished - began,
        "rate": count / (finished - began),
        "consumer_us": consumer_cpu / count * 1e6,
        "broker_us": broker_cpu / count * 1e6,
    }


# -- report --------------------------------------------------------------------------------


def machine() -> str:
    load = os.getloadavg()
    cpus = os.cpu_count()
    shared = "shared with other jobs" if load[0] > 1.0 else "otherwise idle"
    return (
        f"{cpus} vCPU, {platform.python_implementation()} {platform.python_version()}, "
        f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start ({shared})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--store-messages", type=int, default=30_000)
    parser.add_argument("--plain-messages", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--latency-only", action="store_true", help="skip the drains")
    parser.add_argument("--rate", type=float, default=RATE, help="offered msgs/s (latency)")
    parser.add_argument(
        "--publishers",
        type=int,
        default=1,
        help="processes of the publishing service (latency), sharing its 16 threads",
    )
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.store_messages, args.plain_messages = 4.0, 3_000, 10_000
    date = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
    where = machine()
    data = Path(tempfile.mkdtemp(prefix="qmq-bench-consumer-"))
    broker = BenchBroker(data / "broker", "--log-level", "warning")
    broker.start()
    try:
        with fresh_database(
            args.admin_url, prefix="qmq_bench_consumer", tables=(metadata, business)
        ) as db_url:
            lat = latency(broker.url, db_url, args.seconds, args.rate, publishers=args.publishers)
            print("latency", lat, file=sys.stderr, flush=True)
            if args.latency_only:
                return
            one_by_one: dict[str, Any] = {
                "concurrency": 16,
                "prefetch": 64,
                "max_batch": 256,
                "ack_batch_size": 500,
                "wait_ms": 1000,
            }
            store = drain(broker, db_url, args.store_messages, **one_by_one)
            print("store", store, file=sys.stderr, flush=True)
            batched: dict[str, Any] = {
                "concurrency": 4,
                "prefetch": 256,
                "max_batch": 256,
                "ack_batch_size": 500,
                "wait_ms": 1000,
                "store_batch": 32,
            }
            store_b = drain(broker, db_url, args.store_messages, **batched)
            print("store batched", store_b, file=sys.stderr, flush=True)
            store_b2 = drain(broker, db_url, args.store_messages, 2, **batched)
            print("store batched x2", store_b2, file=sys.stderr, flush=True)
            plain = drain(
                broker,
                None,
                args.plain_messages,
                concurrency=4,
                prefetch=2000,
                max_batch=1000,
                ack_batch_size=1000,
                wait_ms=1000,
            )
    finally:
        broker.stop()
    end_load = os.getloadavg()[0]
    command = " ".join(["python bench/consumer_e2e.py", *sys.argv[1:]])
    rows = [
        (
            f"commit -> handler start at {lat['offered_rate']:.0f} msgs/s offered "
            f"({lat['messages']:.0f} msgs after warm-up; {lat['late_share']:.1%} of sends "
            "started >5 ms late), p50",
            f"{lat['p50']:.1f} ms",
            f"<= 10 ms ({verdict(lat['p50'] <= 10)})",
        ),
        (
            "same, p90 / p99 / max",
            f"{lat['p90']:.1f} / {lat['p99']:.1f} / {lat['max']:.1f} ms",
            f"p99 <= 50 ms ({verdict(lat['p99'] <= 50)})",
        ),
        (
            "of which commit -> broker `stored_at` (outbox dispatcher + produce), p50 / p99",
            f"{lat['stored_p50']:.1f} / {lat['stored_p99']:.1f} ms",
            "",
        ),
        (
            "of which `stored_at` -> handler start (pull + dedup insert), p50 / p99",
            f"{lat['handler_p50']:.1f} / {lat['handler_p99']:.1f} ms",
            "",
        ),
        (
            "drain with IdempotentStore on PostgreSQL, one transaction per message "
            f"(`batch_size=1`, the default), 1 consumer process, 16 handler threads "
            f"({store['messages']:.0f} msgs)",
            f"{store['rate']:,.0f} msgs/s",
            f">= 3,000 ({verdict(store['rate'] >= 3000)})",
        ),
        (
            "CPU per message in that run: consumer process / broker",
            f"{store['consumer_us']:.0f} / {store['broker_us']:.0f} µs",
            "",
        ),
        (
            "same with `IdempotentStore(batch_size=32)` (up to 32 queued messages per "
            "transaction), 1 consumer process, 4 handler threads",
            f"{store_b['rate']:,.0f} msgs/s",
            f">= 3,000 ({verdict(store_b['rate'] >= 3000)})",
        ),
        (
            "CPU per message in that run: consumer process / broker",
            f"{store_b['consumer_us']:.0f} / {store_b['broker_us']:.0f} µs",
            "",
        ),
        ("same, 2 consumer processes of the group", f"{store_b2['rate']:,.0f} msgs/s", ""),
        (
            f"drain without the store, 1 consumer process ({plain['messages']:.0f} msgs, "
            "no-op handler)",
            f"{plain['rate']:,.0f} msgs/s",
            f">= 20,000 ({verdict(plain['rate'] >= 20000)})",
        ),
        (
            "CPU per message without the store: consumer process / broker",
            f"{plain['consumer_us']:.0f} / {plain['broker_us']:.0f} µs",
            "",
        ),
    ]
    print(f"\nCommand: `{command}`; {date}; {where}; load average {end_load:.1f} at the end.")
    print("Broker: `qmq broker` subprocess, fsync always; PostgreSQL on loopback.\n")
    print("| measurement | result | target |\n|---|---|---|")
    for label, result, target in rows:
        print(f"| {label} | {result} | {target} |")


def verdict(passed: bool) -> str:
    return "met" if passed else "**missed**"


if __name__ == "__main__":
    main()
