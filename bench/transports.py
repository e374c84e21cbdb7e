"""The same outbox and consumer on each transport: the qmq broker, NATS JetStream, RabbitMQ.

    .venv/bin/python bench/transports.py [--rounds 2] [--seconds 10] [--rate 1000] [--drain 20000]
        [--admin-url URL] [--nats nats://127.0.0.1:4222] [--amqp amqp://guest:guest@...]

Per transport, in rounds (the order rotated each round), all through the SDK:

1. Outbox commit -> handler latency at ``--rate`` (1,000) msgs/s offered: open loop, transaction
   i (one business row + one ``outbox.publish``) starts at ``t0 + i/rate`` on one of 16 producer
   threads, on a fresh PostgreSQL database; the commit time is the wall clock in
   SQLAlchemy's ``after_commit``. One consumer process (``Consumer(transport=...)``, 8
   workers, prefetch 64, ``IdempotentStore(batch_size=32)`` billing each message in the same
   transaction) sends back the wall clock on entry to each handler, by message id. The first
   2 s are warm-up and excluded.
2. Drain: ``--drain`` messages of 100 bytes are stored first through the transport's own
   producer (batches of 100), then one consumer process (8 workers, prefetch 64, a handler
   that does nothing) is told to start; rate = messages / (last handled - start).

The transports as configured here: the qmq broker (``--fsync always``: a produce is answered
once the message is fsynced), JetStream (file storage, one replica: stored in the server's
memory and written to its files, not fsynced per message: a periodic sync),
RabbitMQ (quorum queues, publisher confirms: confirmed once the queue's Raft log has it on
disk). Every name (streams, exchange, queues) is new per run and deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import statistics
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
from bench.consumer_e2e import INSERT_INVOICE, fresh_database, orders, percentile
from qmq_outbox import Consumer, IdempotentStore, Message
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.outbox import Outbox
from qmq_outbox.transports import JetStreamTransport, QmqTransport, RabbitMqTransport, Transport
from qmq_outbox.transports.base import ConsumerSpec

RATE = 1000.0
WARMUP = 2.0
GROUP = "bench"


# -- the consumer process ------------------------------------------------------------------


def consumer_main(
    transport: Transport,
    db_url: str | None,
    subject: str,
    ready: Any,
    go: Any,
    stop: Any,
    handled: Any,
    results: Any,
) -> None:
    """Consume until told to stop; count what was handled, send back handler start times."""
    starts: dict[str, float] = {}
    consumer = Consumer(
        transport=transport, group=GROUP, concurrency=8, prefetch=64, ack_interval=0.05
    )
    engine = None
    lock = threading.Lock()

    def count() -> None:
        with lock, handled.get_lock():
            handled.value += 1

    if db_url is None:

        def plain(message: Message) -> None:
            starts[message.id] = time.time()
            count()

        consumer.add_handler(subject, plain)
    else:
        engine = sa.create_engine(db_url, pool_size=10)
        store = IdempotentStore(sessionmaker(engine), batch_size=32)

        def bill(message: Message, session: Session) -> None:
            starts[message.id] = time.time()
            session.execute(INSERT_INVOICE, {"message_id": message.id, "amount": 1})
            session.info.setdefault("after", []).append(count)

        @event.listens_for(Session, "after_commit")
        def counted(session: Session) -> None:
            for done in session.info.pop("after", []):
                done()

        consumer.add_handler(subject, bill, idempotent=store)
    runner = threading.Thread(target=consumer.run, kwargs={"install_signal_handlers": False})
    ready.set()
    go.wait()
    runner.start()
    stop.wait()
    consumer.stop()
    runner.join(60)
    results.put(starts)
    if engine is not None:
        engine.dispose()


@contextmanager
def consumer(
    transport: Transport, db_url: str | None, subject: str
) -> Iterator[tuple[Any, Any, list[dict[str, float]]]]:
    """One consumer process; yields (go, handled counter, collected start times on exit)."""
    ctx = mp.get_context("spawn")
    ready, go, stop, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    handled = ctx.Value("q", 0)
    proc = ctx.Process(
        target=consumer_main,
        args=(transport, db_url, subject, ready, go, stop, handled, results),
        name="bench-consumer",
    )
    proc.start()
    if not ready.wait(120):
        raise RuntimeError("consumer process did not start")
    collected: list[dict[str, float]] = []
    try:
        yield go, handled, collected
    finally:
        stop.set()
        go.set()
        collected.append(results.get(timeout=120))
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def wait_handled(handled: Any, count: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while handled.value < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {handled.value} of {count} handled")
        time.sleep(0.002)
    return time.time()


async def _declare(transport: Transport, subject: str) -> None:
    """Set up the group's storage before anything is produced (RabbitMQ: its queue must
    exist for a message to be routed)."""
    spec = ConsumerSpec(
        group=GROUP,
        consumer_id="bench-declare",
        subjects=(subject,),
        start="earliest",
        capacity=1,
        connections=1,
    )
    client = await transport.open_consumer(spec)
    try:  # an empty pull: the group's queue, stream consumer or cursor exists from now on
        assert await client.pull(subject, GROUP, spec.consumer_id, max_messages=1, wait_ms=0) == []
    finally:
        await client.aclose()


# -- 1. latency ----------------------------------------------------------------------------


def latency(
    transport: Transport, db_url: str, seconds: float, rate: float, threads: int = 16
) -> dict[str, float]:
    subject = f"bench.e2e{uuid.uuid4().hex[:6]}"
    count = int(rate * seconds)
    engine = sa.create_engine(db_url, pool_size=threads + 2)
    maker = sessionmaker(engine)
    outbox = Outbox(transport=transport, app="bench")
    outbox.install(maker)

    @event.listens_for(maker, "after_commit")
    def committed(session: Session) -> None:
        session.info["committed_at"] = time.time()

    commits: dict[str, float] = {}
    slots = iter(range(count))
    lock = threading.Lock()
    asyncio.run(_declare(transport, subject))
    with consumer(transport, db_url, subject) as (go, handled, collected):
        go.set()
        time.sleep(1.0)  # the consumer's first pull reaches the transport
        start = time.perf_counter() + 0.05

        def produce() -> None:
            while True:
                with lock:
                    i = next(slots, None)
                if i is None:
                    return
                pause = start + i / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                with maker.begin() as session:
                    session.execute(sa.insert(orders).values(id=i, amount=i))
                    message_id = outbox.publish(session, subject, {"order": i})
                commits[message_id] = session.info["committed_at"]

        workers = [threading.Thread(target=produce) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        offered = count / (time.perf_counter() - start)
        wait_handled(handled, count)
    starts = collected[0]
    outbox.close()
    with engine.begin() as conn:  # the next transport's run starts from empty tables
        conn.execute(sa.delete(orders))
        conn.execute(sa.text("DELETE FROM bench_invoices"))
        conn.execute(sa.text("DELETE FROM qmq_outbox"))
        conn.execute(sa.text("DELETE FROM qmq_consumed"))
    engine.dispose()
    skip = int(rate * WARMUP)
    ordered = sorted(commits.items(), key=lambda item: item[1])[skip:]
    delays = [(starts[mid] - at) * 1000 for mid, at in ordered if mid in starts]
    if len(delays) != len(ordered):
        raise AssertionError(f"{len(ordered) - len(delays)} messages never reached a handler")
    return {
        "offered": offered,
        "p50": statistics.median(delays),
        "p99": percentile(delays, 0.99),
        "max": max(delays),
    }


# -- 2. drain ------------------------------------------------------------------------------


def drain(transport: Transport, count: int) -> float:
    subject = f"bench.drain{uuid.uuid4().hex[:6]}"
    asyncio.run(_declare(transport, subject))
    producer = transport.producer()
    try:
        for first in range(0, count, 100):
            batch = [
                OutgoingMessage(id=f"{subject}-{n}", subject=subject, body=b"x" * 100)
                for n in range(first, min(count, first + 100))
            ]
            outcomes = producer.produce(batch)
            failed = [o for o in outcomes if getattr(o, "status", None) != "stored"]
            if failed:
                raise RuntimeError(f"preload failed: {failed[0]!r}")
    finally:
        producer.close()
    with consumer(transport, None, subject) as (go, handled, _):
        began = time.time()
        go.set()
        finished = wait_handled(handled, count)
    return count / (finished - began)


# -- clean-up of the peers' names ----------------------------------------------------------


async def _drop_nats(url: str, prefix: str) -> None:
    import nats

    client = await nats.connect(url)
    try:
        js = client.jetstream()
        for name in await js.streams_info():
            if name.config.name and name.config.name.startswith(prefix):
                await js.delete_stream(name.config.name)
    finally:
        await client.close()


async def _drop_rabbit(url: str, exchange: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.exchange_delete(exchange)
    finally:
        await connection.close()


def _drop_rabbit_queues(prefix: str) -> None:
    """Queues are named ``<group>.<subject>``: every one of this run's starts with it."""
    import subprocess

    listed = subprocess.run(
        ["rabbitmqctl", "list_queues", "name", "--quiet"],
        capture_output=True,
        text=True,
        check=False,
    )
    for name in listed.stdout.split():
        if name.startswith(prefix):
            subprocess.run(["rabbitmqctl", "delete_queue", name], capture_output=True, check=False)


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=RATE, help="msgs/s offered (latency)")
    parser.add_argument("--drain", type=int, default=20_000, help="backlog drained; 0: none")
    parser.add_argument(
        "--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/")
    args = parser.parse_args()
    tag = uuid.uuid4().hex[:6]
    print(f"load at start: {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    data = Path(tempfile.mkdtemp(prefix="qmq-bench-transports-"))
    broker = BenchBroker(data / "broker", "--fsync", "always", "--log-level", "warning")
    broker.start()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, data, ignore_errors=True)
        stack.callback(broker.stop)
        db_url = stack.enter_context(fresh_database(args.admin_url))
        transports: list[tuple[str, Transport]] = [
            ("qmq broker", QmqTransport(url=broker.url)),
            ("JetStream", JetStreamTransport(url=args.nats, stream_prefix=f"BENCH{tag.upper()}")),
            ("RabbitMQ", RabbitMqTransport(url=args.amqp, exchange=f"bench-{tag}")),
        ]
        try:
            for round_no in range(args.rounds):
                turn = round_no % len(transports)
                for name, transport in transports[turn:] + transports[:turn]:
                    seen = results.setdefault(name, {"p50": [], "p99": [], "drain": []})
                    figures = latency(transport, db_url, args.seconds, args.rate)
                    rate = drain(transport, args.drain) if args.drain else float("nan")
                    seen["p50"].append(figures["p50"])
                    seen["p99"].append(figures["p99"])
                    seen["drain"].append(rate)
                    print(
                        f"round {round_no + 1} {name:<10} offered {figures['offered']:6,.0f}/s "
                        f"p50 {figures['p50']:6.1f} ms p99 {figures['p99']:7.1f} ms "
                        f"max {figures['max']:7.1f} ms  drain {rate:8,.0f} msgs/s "
                        f"(load {os.getloadavg()[0]:.2f})",
                        flush=True,
                    )
        finally:
            asyncio.run(_drop_nats(args.nats, f"BENCH{tag.upper()}"))
            asyncio.run(_drop_rabbit(args.amqp, f"bench-{tag}"))
            _drop_rabbit_queues(f"{GROUP}.bench.")
    print(f"\nload at end: {os.getloadavg()[0]:.2f}\n")
    print("| transport | p50 (ms) | p99 (ms) | drain (msgs/s) |")
    print("|---|---|---|---|")
    for name, seen in results.items():
        cells = [
            " / ".join(f"{v:.1f}" for v in seen["p50"]),
            " / ".join(f"{v:.1f}" for v in seen["p99"]),
            " / ".join(f"{v:,.0f}" for v in seen["drain"]),
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
