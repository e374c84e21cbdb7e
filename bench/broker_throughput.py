"""Broker throughput, latency, recovery and memory, with the project's own async client.

    .venv/bin/python bench/broker_throughput.py [--produce-seconds 15] [--recovery-messages 1000000]

1. durable produce (fsync always): 1 KiB bodies, batches of 100, 8 connections;
2. single-message produce latency on one connection;
3. pull + ack in batches of 100 (4 consumers of one shared group);
4. recovery after kill -9 with N stored messages, and RSS with them stored.
The load generator runs in this process; the broker in its own process, as users run it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._broker import BenchBroker
from qmq_outbox.client import AsyncBrokerClient
from qmq_outbox.envelope import OutgoingMessage

BODY = b"x" * 1024


def batch(prefix: str, start: int, size: int, subject: str) -> list[OutgoingMessage]:
    return [
        OutgoingMessage(id=f"{prefix}-{n}", subject=subject, body=BODY)
        for n in range(start, start + size)
    ]


async def durable_produce(
    url: str, seconds: float, connections: int = 8, size: int = 100
) -> tuple[float, int]:
    counter = 0
    stop_at = time.monotonic() + seconds

    async def worker(client: AsyncBrokerClient, worker_id: int) -> int:
        nonlocal counter
        sent = 0
        while time.monotonic() < stop_at:
            start = counter
            counter += size
            await client.produce(batch(f"p{worker_id}", start, size, "bench.produce"))
            sent += size
        return sent

    async with AsyncBrokerClient(url, max_connections=connections) as client:
        began = time.monotonic()
        sent = await asyncio.gather(*(worker(client, i) for i in range(connections)))
        elapsed = time.monotonic() - began
    return sum(sent) / elapsed, sum(sent)


async def single_latency(url: str, count: int = 3000) -> list[float]:
    latencies = []
    async with AsyncBrokerClient(url, max_connections=1) as client:
        for n in range(count):
            began = time.perf_counter()
            await client.produce(batch("single", n, 1, "bench.single"))
            latencies.append(time.perf_counter() - began)
    return latencies


async def pull_ack(url: str, total: int, consumers: int = 4, size: int = 100) -> float:
    received = 0

    async def worker(client: AsyncBrokerClient, consumer: str) -> None:
        nonlocal received
        while received < total:
            messages = await client.pull(
                "bench.produce", "bench", consumer, max_messages=size, wait_ms=500
            )
            if not messages:
                return
            await client.ack("bench.produce", "bench", consumer, [m.seq for m in messages])
            received += len(messages)

    async with AsyncBrokerClient(url, max_connections=consumers) as client:
        began = time.monotonic()
        await asyncio.gather(*(worker(client, f"c{i}") for i in range(consumers)))
        return received / (time.monotonic() - began)


async def fill(url: str, total: int, connections: int = 8, size: int = 500) -> None:
    async def worker(client: AsyncBrokerClient, worker_id: int) -> None:
        for start in range(worker_id * size, total, connections * size):
            await client.produce(batch("fill", start, min(size, total - start), "bench.fill"))

    async with AsyncBrokerClient(url, max_connections=connections, timeout=120) as client:
        await asyncio.gather(*(worker(client, i) for i in range(connections)))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1]


def recovered_seconds(log: Path) -> float:
    found = re.findall(r'"action": "broker.recovered", "seconds": ([0-9.]+)', log.read_text())
    return float(found[-1]) if found else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--produce-seconds", type=float, default=15)
    parser.add_argument("--recovery-messages", type=int, default=1_000_000)
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("QMQ_BENCH_DIR")) as tmp:
        broker = BenchBroker(Path(tmp) / "data")
        broker.start()
        try:
            cpu0 = broker.cpu_seconds()
            rate, sent = asyncio.run(durable_produce(broker.url, args.produce_seconds))
            cpu = (broker.cpu_seconds() - cpu0) / args.produce_seconds
            rows.append(
                (
                    "durable produce, 1 KiB, batches of 100, 8 connections",
                    f"{rate:,.0f} msgs/s",
                    "≥ 50,000 msgs/s",
                    f"{sent:,} msgs; broker CPU {cpu:.2f} cores",
                )
            )
            latencies = asyncio.run(single_latency(broker.url))
            rows.append(
                (
                    "single-message produce p50",
                    f"{pct(latencies, 0.5) * 1000:.2f} ms",
                    "≤ 2 ms",
                    "fsync always, 1 connection",
                )
            )
            rows.append(
                (
                    "single-message produce p99",
                    f"{pct(latencies, 0.99) * 1000:.2f} ms",
                    "≤ 10 ms",
                    f"{len(latencies)} requests",
                )
            )
            rate = asyncio.run(pull_ack(broker.url, min(sent, 300_000)))
            rows.append(
                (
                    "pull + ack, batches of 100, 4 consumers",
                    f"{rate:,.0f} msgs/s",
                    "≥ 30,000 msgs/s",
                    "shared group",
                )
            )
        finally:
            broker.stop()

    with tempfile.TemporaryDirectory(dir=os.environ.get("QMQ_BENCH_DIR")) as tmp:
        broker = BenchBroker(Path(tmp) / "data", "--fsync", "interval:50")
        broker.start()
        try:
            began = time.monotonic()
            asyncio.run(fill(broker.url, args.recovery_messages))
            fill_rate = args.recovery_messages / (time.monotonic() - began)
            rss_loaded = broker.rss_mb()
            broker.kill9()
            until_healthy = broker.start(timeout=600)
            rss_recovered = broker.rss_mb()
            rows.append(
                (
                    f"recovery after kill -9, {args.recovery_messages:,} stored",
                    f"{recovered_seconds(broker.log):.2f} s",
                    "≤ 10 s",
                    f"{until_healthy:.2f} s from exec to /healthz 200"
                    f" (filled at {fill_rate:,.0f} msgs/s)",
                )
            )
            rows.append(
                (
                    f"broker RSS, {args.recovery_messages:,} x 1 KiB stored",
                    f"{max(rss_loaded, rss_recovered):.0f} MB",
                    "≤ 300 MB",
                    f"{rss_loaded:.0f} MB after filling, {rss_recovered:.0f} MB after recovery",
                )
            )
        finally:
            broker.stop()

    print(
        f"\n`python bench/broker_throughput.py --produce-seconds {args.produce_seconds:g} "
        f"--recovery-messages {args.recovery_messages}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.node()}: {os.cpu_count()} vCPU, Python {platform.python_version()}\n"
    )
    print("| measure | result | target | notes |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
