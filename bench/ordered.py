"""Ordered subjects: what per-key order costs, and how fast a split takes effect (issue 16);
with ``--part keys``, what a slow key costs the other keys of its partition (issue 39).

    .venv/bin/python bench/ordered.py [--rounds 3] [--messages 6000] [--keys 2000]
        [--handler-ms 2] [--concurrency 8]
    .venv/bin/python bench/ordered.py --part keys [--rounds 3] [--messages 5000]
        [--keys 1000] [--handler-ms 5] [--slow-s 2] [--concurrency 8] [--consumers 1]

``--part keys`` is described in ``bench/_ordered_keys.py``.

Throughput: 3 consumer processes (the SDK's ``Consumer``, ``--concurrency`` handler
threads each, a handler that sleeps ``--handler-ms``) are started and left to wait in their
long polls; then ``--messages`` 1 KiB messages over ``--keys`` keys are stored as fast as
the project's ``AsyncBrokerClient`` can (batches of 100); timed from the first produce to
the last message handled.
Subjects: an unordered one (shared mode) and ordered ones with 1, 4 and 16 partitions
(``@consumer.handler(subject, ordered=True)``), in rounds, the order rotated each round;
per round the ordered / unordered ratio. Every run also checks that each key's messages
were handled in the order they were stored.

Split: with 4 partitions, producers at ``--split-rate`` msgs/s and the 3 consumers
running, partition 0 is split in two; timed from the split's answer to the first message
of a new partition handled (the group first drains partition 0 up to its command).

One broker (``qmq broker --fsync always``) on a temporary data directory serves it all.
Benchmark on a quiet box: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _ordered_keys
from bench._cli import positive
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.consumer import Consumer
from qmq_outbox.envelope import Message, OutgoingMessage
from tests.support.broker_process import BrokerProcess

CONSUMERS = 3
STARTUP_S = 4.0
GROUP = "bench"
BODY = b"x" * 1000


def consumer_main(
    url: str,
    subject: str,
    ordered: bool,
    concurrency: int,
    handler_s: float,
    name: str,
    out: Any,
    stop: EventType,
) -> None:
    """One consumer process: handles, then reports (key, n, partition, seq, time) rows."""
    consumer = Consumer(url, GROUP, consumer_id=name, concurrency=concurrency, wait_ms=200)
    rows: list[tuple[str, int, int | None, int, float]] = []

    @consumer.handler(subject, ordered=ordered)
    def handle(message: Message) -> None:
        time.sleep(handler_s)
        body = json.loads(message.body)
        rows.append((body["k"], body["n"], message.partition, message.seq, time.time()))

    import threading

    runner = threading.Thread(target=consumer.run, kwargs={"install_signal_handlers": False})
    runner.start()
    stop.wait()
    consumer.stop()
    runner.join(60)
    out.put(rows)


class Consumers:
    def __init__(
        self, url: str, subject: str, *, ordered: bool, concurrency: int, handler_s: float
    ):
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.out = context.Queue()
        self.procs = [
            context.Process(
                target=consumer_main,
                args=(url, subject, ordered, concurrency, handler_s, f"c{n}", self.out, self.stop),
            )
            for n in range(CONSUMERS)
        ]

    def start(self) -> float:
        for proc in self.procs:
            proc.start()
        return time.time()

    def finish(self) -> list[tuple[str, int, int | None, int, float]]:
        self.stop.set()
        rows: list[tuple[str, int, int | None, int, float]] = []
        for _ in self.procs:
            rows.extend(self.out.get(timeout=120))
        for proc in self.procs:
            proc.join(30)
        return rows


async def store_backlog(url: str, subject: str, messages: int, keys: int, tag: str) -> None:
    async with AsyncBrokerClient(url) as client:
        batch: list[OutgoingMessage] = []
        for n in range(messages):
            key = f"k{n % keys}"
            body = json.dumps({"k": key, "n": n // keys, "pad": "x" * 980}).encode()
            batch.append(OutgoingMessage(id=f"{tag}-{n}", subject=subject, key=key, body=body))
            if len(batch) == 100:
                await client.produce(batch)
                batch = []
        if batch:
            await client.produce(batch)


def check_order(rows: list[tuple[str, int, int | None, int, float]]) -> None:
    """Each key's handled numbers, by handling time, come in the order they were stored."""
    _ordered_keys.check_order([(key, n, at) for key, n, _, _, at in rows])


def drain(
    broker: BrokerProcess,
    subject: str,
    partitions: int | None,
    args: argparse.Namespace,
    tag: str,
) -> float:
    """Messages per second for one subject: backlog first, then 3 consumers drain it."""
    if partitions is not None:
        with BrokerClient(broker.url) as client:
            client.declare_subject(subject, partitions=partitions)
    consumers = Consumers(
        broker.url,
        subject,
        ordered=partitions is not None,
        concurrency=args.concurrency,
        handler_s=args.handler_ms / 1000,
    )
    consumers.start()
    time.sleep(STARTUP_S)  # the processes import, start and wait in their long polls
    began = time.time()
    asyncio.run(store_backlog(broker.url, subject, args.messages, args.keys, tag))
    with BrokerClient(broker.url) as client:
        while True:
            groups = client.subject(subject)["groups"]
            done = sum(g["acked"] for g in groups)
            if done >= args.messages:
                break
            time.sleep(0.05)
    rows = consumers.finish()
    last = max(at for *_, at in rows)
    if partitions is not None:
        check_order(rows)
    handled = len({(k, n) for k, n, *_ in rows})
    if handled != args.messages:
        raise AssertionError(f"{subject}: {handled} of {args.messages} handled")
    return float(args.messages / (last - began))


def split_time(broker: BrokerProcess, args: argparse.Namespace, tag: str) -> dict[str, float]:
    """Seconds from a split's answer until a new partition's first message is handled."""
    subject = f"split.{tag}"
    with BrokerClient(broker.url) as client:
        client.declare_subject(subject, partitions=4)
    consumers = Consumers(
        broker.url,
        subject,
        ordered=True,
        concurrency=args.concurrency,
        handler_s=args.handler_ms / 1000,
    )
    consumers.start()
    stop = asyncio.Event()

    async def produce() -> None:
        async with AsyncBrokerClient(broker.url) as client:
            n = 0
            interval = 100 / args.split_rate
            while not stop.is_set():
                batch = [
                    OutgoingMessage(
                        id=f"{tag}-s{n + i}",
                        subject=subject,
                        key=f"k{(n + i) % args.keys}",
                        body=json.dumps(
                            {"k": f"k{(n + i) % args.keys}", "n": (n + i) // args.keys}
                        ).encode(),
                    )
                    for i in range(100)
                ]
                await client.produce(batch)
                n += 100
                await asyncio.sleep(interval)

    async def run() -> tuple[float, float]:
        task = asyncio.create_task(produce())
        await asyncio.sleep(3.0)  # consumers settled, partitions leased
        async with AsyncBrokerClient(broker.url) as client:
            routes = await client.split_partition(subject, partition=0, at=128)
        answered = time.time()
        await asyncio.sleep(args.after_split)
        stop.set()
        await task
        return answered, float(routes["version"])

    answered, _ = asyncio.run(run())
    time.sleep(1.0)
    rows = consumers.finish()
    check_order(rows)
    new = sorted(at for _, _, partition, _, at in rows if partition in (4, 5))
    old_last = max(at for _, _, partition, _, at in rows if partition == 0)
    if not new:
        raise AssertionError("no message of a new partition was handled")
    return {"first_new": new[0] - answered, "old_drained": old_last - answered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("partitions", "keys"), default="partitions")
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--messages", type=positive, help="6000; --part keys: 5000")
    parser.add_argument("--keys", type=positive, help="2000; --part keys: 1000")
    parser.add_argument("--handler-ms", type=float, help="2; --part keys: 5")
    parser.add_argument("--concurrency", type=positive, default=8)
    parser.add_argument("--split-rate", type=float, default=1000.0, help="msgs/s during the split")
    parser.add_argument("--after-split", type=float, default=4.0, help="seconds of load after it")
    _ordered_keys.add_arguments(parser)
    args = parser.parse_args()
    keyed = args.part == "keys"
    for name, partitions_default, keys_default in (
        ("messages", 6000, 5000),
        ("keys", 2000, 1000),
        ("handler_ms", 2.0, 5.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, keys_default if keyed else partitions_default)
    if keyed:
        _ordered_keys.main(args)
        return
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    systems: list[tuple[str, int | None]] = [
        ("unordered", None),
        ("ordered 1", 1),
        ("ordered 4", 4),
        ("ordered 16", 16),
    ]
    rates: dict[str, list[float]] = {name: [] for name, _ in systems}
    splits: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="qmq-bench-ordered-") as work:
        broker = BrokerProcess(Path(work) / "data").start()
        try:
            for round_no in range(args.rounds):
                turn = systems[round_no % len(systems) :] + systems[: round_no % len(systems)]
                for name, partitions in turn:
                    tag = f"r{round_no}-{name.replace(' ', '')}"
                    rate = drain(broker, f"bench.{tag}", partitions, args, tag)
                    rates[name].append(rate)
                    print(f"round {round_no + 1} {name:<11} {rate:8,.0f} msgs/s", flush=True)
                split = split_time(broker, args, f"r{round_no}")
                splits.append(split)
                print(
                    f"round {round_no + 1} split: first new-partition message handled "
                    f"{split['first_new'] * 1000:.0f} ms after the answer (old partition "
                    f"drained at {split['old_drained'] * 1000:.0f} ms)",
                    flush=True,
                )
        finally:
            broker.stop()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print(
        f"{args.messages:,} msgs of 1 KiB over {args.keys:,} keys, {CONSUMERS} consumer processes "
        f"x {args.concurrency} handler threads, handler {args.handler_ms:g} ms"
    )
    print()
    print("| subject | " + " | ".join(f"round {n + 1}" for n in range(args.rounds)) + " | median |")
    print("|---|" + "---|" * (args.rounds + 1))
    for name, values in rates.items():
        cells = " | ".join(f"{v:,.0f}" for v in values)
        print(f"| {name} (msgs/s) | {cells} | {statistics.median(values):,.0f} |")
    for name, values in rates.items():
        if name == "unordered":
            continue
        ratios = [v / u for v, u in zip(values, rates["unordered"], strict=True)]
        cells = " | ".join(f"{r:.2f}" for r in ratios)
        print(f"| {name} / unordered | {cells} | {statistics.median(ratios):.2f} |")
    cells = " | ".join(f"{s['first_new'] * 1000:.0f}" for s in splits)
    median = statistics.median(s["first_new"] * 1000 for s in splits)
    print(f"| split to first new-partition message (ms) | {cells} | {median:.0f} |")


if __name__ == "__main__":
    main()
