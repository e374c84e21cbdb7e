"""``bench/ordered.py --part keys``: what a slow key costs the other keys of its partition
(issue 39).

One subject with one partition, ``--keys`` keys, ``--messages`` messages of 1 KiB stored
as fast as the project's ``AsyncBrokerClient`` can (batches of 100) once the consumers wait
in their long polls. ``--consumers`` consumer processes (the SDK's ``Consumer``,
``--concurrency`` handler threads each) run a handler that sleeps ``--handler-ms``, and
``--slow-s`` for every message of one key. Measured: the other keys' messages per second,
from the first produce to the last of them handled, and the CPU per message of every
process (the broker; the consumers together), from the first produce until every message
is acked. Systems, in rounds, the order rotated each round:

- ``per-key``: ordered, ``@consumer.handler(subject, ordered=True)`` as configured by
  default (``ordered_keys`` = 2 x concurrency keys in flight per partition);
- ``limit 1``: the same with ``ordered_keys=1``: the partition one batch at a time (a
  batch's keys still run side by side in the consumer);
- ``unordered``: a plain subject in shared mode.

Every ordered run checks that each key's messages were handled in the order they were
stored. Target: per-key / unordered >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import psutil

from bench._peers.common import rotated
from bench._peers.meter import cpu_snapshot, cpu_spent
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.consumer import Consumer
from qmq_outbox.envelope import Message, OutgoingMessage
from tests.support.broker_process import BrokerProcess

GROUP = "bench"
SLOW_KEY = "k0"
STARTUP_S = 4.0
SYSTEMS: dict[str, tuple[bool, int | None]] = {  # name -> (ordered, ordered_keys)
    "per-key": (True, None),
    "limit 1": (True, 1),
    "unordered": (False, None),
}
Row = tuple[str, int, float]  # key, n, handled at (time.time())


def consumer_main(
    url: str, subject: str, system: str, args: argparse.Namespace, name: str, out: Any, stop: Any
) -> None:
    """One consumer process: handles until ``stop``, then reports its rows."""
    ordered, ordered_keys = SYSTEMS[system]
    consumer = Consumer(
        url,
        GROUP,
        consumer_id=name,
        concurrency=args.concurrency,
        wait_ms=200,
        ordered_keys=ordered_keys,
    )
    rows: list[Row] = []

    @consumer.handler(subject, ordered=ordered)
    def handle(message: Message) -> None:
        body = json.loads(message.body)
        time.sleep(args.slow_s if body["k"] == SLOW_KEY else args.handler_ms / 1000)
        rows.append((body["k"], body["n"], time.time()))

    runner = threading.Thread(target=consumer.run, kwargs={"install_signal_handlers": False})
    runner.start()
    stop.wait()
    consumer.stop()
    runner.join(120)
    out.put(rows)


async def store(url: str, subject: str, args: argparse.Namespace) -> None:
    """Key k{n % keys} gets message n // keys: every key's messages spread over the run."""
    async with AsyncBrokerClient(url) as client:
        batch: list[OutgoingMessage] = []
        for n in range(args.messages):
            key = f"k{n % args.keys}"
            body = json.dumps({"k": key, "n": n // args.keys, "pad": "x" * 980}).encode()
            batch.append(OutgoingMessage(id=f"{subject}-{n}", subject=subject, key=key, body=body))
            if len(batch) == 100:
                await client.produce(batch)
                batch = []
        if batch:
            await client.produce(batch)


def check_order(rows: list[Row]) -> None:
    """Each key's handled numbers ``(key, n, at)``, by handling time, in stored order."""
    by_key: dict[str, list[tuple[float, int]]] = {}
    for key, n, at in rows:
        by_key.setdefault(key, []).append((at, n))
    for key, handled in by_key.items():
        numbers = [n for _, n in sorted(handled)]
        if numbers != sorted(numbers):
            raise AssertionError(f"key {key} handled out of order: {numbers[:10]}")


def run_one(
    broker: BrokerProcess, system: str, args: argparse.Namespace, tag: str
) -> dict[str, float]:
    """One system once: the other keys' msgs/s, and CPU microseconds per message."""
    subject = f"keys.{tag}"
    ordered, _ = SYSTEMS[system]
    if ordered:
        with BrokerClient(broker.url) as client:
            client.declare_subject(subject, partitions=1)
    context = multiprocessing.get_context("spawn")
    stop: EventType = context.Event()
    out = context.Queue()
    procs = [
        context.Process(
            target=consumer_main, args=(broker.url, subject, system, args, f"c{n}", out, stop)
        )
        for n in range(args.consumers)
    ]
    for proc in procs:
        proc.start()
    time.sleep(STARTUP_S)  # the processes import, start and wait in their long polls
    assert broker.proc is not None
    roles = {
        "broker": [psutil.Process(broker.proc.pid)],
        "consumers": [psutil.Process(p.pid) for p in procs],
    }
    before = {role: cpu_snapshot(found) for role, found in roles.items()}
    began = time.time()
    asyncio.run(store(broker.url, subject, args))
    others = args.messages - len(range(0, args.messages, args.keys))  # all but the slow key's
    with BrokerClient(broker.url) as client:
        while sum(g["acked"] for g in client.subject(subject)["groups"]) < args.messages:
            time.sleep(0.05)
    after = {role: cpu_snapshot(found) for role, found in roles.items()}
    stop.set()
    rows: list[Row] = []
    for _ in procs:
        rows.extend(out.get(timeout=180))
    for proc in procs:
        proc.join(60)
    if ordered:
        check_order(rows)
    if len({(k, n) for k, n, _ in rows}) != args.messages:
        raise AssertionError(f"{subject}: not every message was handled")
    last_other = max(at for key, _, at in rows if key != SLOW_KEY)
    cpu = {role: cpu_spent(before[role], after[role]) / args.messages * 1e6 for role in roles}
    return {"rate": others / (last_other - began)} | {f"{role}_us": v for role, v in cpu.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slow-s", type=float, default=2.0, help="the slow key's handler (s)")
    parser.add_argument("--consumers", type=int, default=1, help="consumer processes")


def main(args: argparse.Namespace) -> None:
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SYSTEMS}
    with tempfile.TemporaryDirectory(prefix="qmq-bench-keys-") as work:
        broker = BrokerProcess(Path(work) / "data").start()
        try:
            for round_no in range(args.rounds):
                for system in rotated(list(SYSTEMS), round_no):
                    tag = f"r{round_no}-{system.replace(' ', '').replace('-', '')}"
                    result = run_one(broker, system, args, tag)
                    results[system].append(result)
                    print(
                        f"round {round_no + 1} {system:<10} {result['rate']:8,.0f} msgs/s of "
                        f"the other keys; CPU per message: broker {result['broker_us']:,.0f} "
                        f"us, consumers {result['consumers_us']:,.0f} us",
                        flush=True,
                    )
        finally:
            broker.stop()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print(
        f"1 partition, {args.messages:,} msgs of 1 KiB over {args.keys:,} keys, "
        f"{args.consumers} consumer process(es) x {args.concurrency} handler threads, handler "
        f"{args.handler_ms:g} ms, key {SLOW_KEY} {args.slow_s:g} s per message"
    )
    print()
    print("| | " + " | ".join(f"round {n + 1}" for n in range(args.rounds)) + " | median |")
    print("|---|" + "---|" * (args.rounds + 1))
    for system, runs in results.items():
        for what, unit in (
            ("rate", "other keys' msgs/s"),
            ("broker_us", "broker CPU us/msg"),
            ("consumers_us", "consumers' CPU us/msg"),
        ):
            values = [run[what] for run in runs]
            cells = " | ".join(f"{v:,.0f}" for v in values)
            print(f"| {system}: {unit} | {cells} | {statistics.median(values):,.0f} |")
    for num, den in (("per-key", "unordered"), ("limit 1", "unordered"), ("per-key", "limit 1")):
        ratios = [a["rate"] / b["rate"] for a, b in zip(results[num], results[den], strict=True)]
        cells = " | ".join(f"{r:.2f}" for r in ratios)
        print(f"| {num} / {den} | {cells} | {statistics.median(ratios):.2f} |")
