"""Pull + ack throughput under ``--ack-fsync always`` and a relaxed policy, in rounds.

    .venv/bin/python bench/ack_fsync.py --rounds 4 --messages 200000 --relaxed interval:5

Each run starts a fresh broker (``--fsync always``, the ``--ack-fsync`` policy under test),
stores ``--messages`` messages of 1 KiB (batches of 100 on 8 connections), then drains them with
4 consumers of one shared group pulling batches of 100 and acking each batch before the
next pull (``broker_throughput.pull_ack``, the project's ``AsyncBrokerClient``). It reports
the drain rate, the fsyncs the broker made while draining (its ``/metrics``) and its CPU
per message. The two policies alternate (ABBA) and the relaxed / always ratio is printed
per round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._broker import BenchBroker
from bench.broker_throughput import batch, pull_ack
from qmq_outbox.client import AsyncBrokerClient

FSYNCS = re.compile(r"^qmq_broker_fsync_seconds_count (\S+)$", re.MULTILINE)


def fsyncs(url: str) -> float:
    found = FSYNCS.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(found.group(1)) if found else float("nan")


async def store(url: str, total: int, connections: int = 8) -> None:
    """``total`` messages on the subject ``pull_ack`` drains, in batches of 100."""

    async def worker(client: AsyncBrokerClient, number: int) -> None:
        for start in range(number * 100, total, connections * 100):
            await client.produce(batch("a", start, min(100, total - start), "bench.produce"))

    async with AsyncBrokerClient(url, max_connections=connections, timeout=120) as client:
        await asyncio.gather(*(worker(client, n) for n in range(connections)))


def one_run(policy: str, messages: int) -> tuple[float, float, float]:
    """(msgs/s drained, fsyncs per 1,000 messages, broker CPU us per message)."""
    with tempfile.TemporaryDirectory(prefix="qmq-ack-fsync-") as tmp:
        broker = BenchBroker(Path(tmp) / "data", "--fsync", "always", "--ack-fsync", policy)
        broker.start()
        try:
            asyncio.run(store(broker.url, messages))
            time.sleep(0.5)
            before_fsyncs, before_cpu = fsyncs(broker.url), broker.cpu_seconds()
            rate = asyncio.run(pull_ack(broker.url, messages))
            made = fsyncs(broker.url) - before_fsyncs
            cpu_us = (broker.cpu_seconds() - before_cpu) / messages * 1e6
            return rate, made / messages * 1000, cpu_us
        finally:
            broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--relaxed", default="interval:5", help="the --ack-fsync to compare")
    args = parser.parse_args()
    print(
        f"pull + ack, 4 consumers, batches of 100, {args.messages:,} x 1 KiB; --fsync always; "
        f"--ack-fsync always against {args.relaxed}; load at start {os.getloadavg()}"
    )
    ratios = []
    for number in range(args.rounds):
        order = ["always", args.relaxed] if number % 2 == 0 else [args.relaxed, "always"]
        got = {policy: one_run(policy, args.messages) for policy in order}
        ratios.append(got[args.relaxed][0] / got["always"][0])
        cells = " | ".join(
            f"{policy}: {rate:,.0f}/s, {made:.1f} fsyncs per 1k msgs, broker {cpu:.1f} us/msg"
            for policy, (rate, made, cpu) in got.items()
        )
        print(f"round {number + 1}: {cells} | relaxed/always {ratios[-1]:.2f}", flush=True)
    print(
        f"median relaxed/always {statistics.median(ratios):.2f} over {len(ratios)} rounds; "
        f"load at end {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
