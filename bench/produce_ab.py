"""Durable produce throughput of two builds of the broker, side by side, in rounds.

    .venv/bin/python bench/produce_ab.py --before /tmp/old --rounds 8 --seconds 10

``--before`` and ``--after`` are checkouts of this repository (``git archive <commit> | tar
-x -C /tmp/old``; ``--after`` defaults to this one). Each round starts a fresh broker of
each build on a new data directory (``python -m qmq_outbox broker`` run from the checkout,
so it imports that checkout's code) and drives it with this checkout's
``AsyncBrokerClient``: 8 connections, batches of 100 messages of 1 KiB with new ids, for
``--seconds`` (``broker_throughput.durable_produce``). The order alternates (ABBA), so drift
in the box hits both builds alike. Prints, per round, each build's messages/s, its
broker's CPU per message (utime + stime from ``/proc``) and this process's (the client's),
and the after / before ratio; then the median ratio and the load average at both ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._broker import BenchBroker
from bench.broker_throughput import durable_produce

HERE = Path(__file__).resolve().parent.parent


def one_run(
    checkout: Path, *, seconds: float, fsync: str, root: Path
) -> tuple[float, float, float]:
    """(messages/s, broker CPU us/msg, client CPU us/msg) of one fresh broker of ``checkout``."""
    broker = BenchBroker(
        Path(tempfile.mkdtemp(dir=root)) / "data", "--fsync", fsync, checkout=checkout
    )
    broker.start(timeout=60)
    try:
        cpu_before, client_before = broker.cpu_seconds(), time.process_time()
        rate, sent = asyncio.run(durable_produce(broker.url, seconds))
        broker_us = (broker.cpu_seconds() - cpu_before) / sent * 1e6
        client_us = (time.process_time() - client_before) / sent * 1e6
        return rate, broker_us, client_us
    finally:
        broker.stop()
        shutil.rmtree(broker.data_dir.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the old build")
    parser.add_argument("--after", type=Path, default=HERE, help="checkout of the new build")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="produce time per run")
    parser.add_argument("--fsync", default="always", help="the brokers' --fsync policy")
    args = parser.parse_args()
    builds = {"before": args.before.resolve(), "after": args.after.resolve()}
    root = Path(tempfile.mkdtemp(prefix="qmq-produce-ab-"))
    print(f"durable produce, 8 connections x 100 x 1 KiB, {args.seconds:g} s per run, "
          f"--fsync {args.fsync}; load at start {os.getloadavg()}")  # fmt: skip
    ratios = []
    try:
        for number in range(args.rounds):
            order = ("before", "after") if number % 2 == 0 else ("after", "before")
            got = {
                name: one_run(builds[name], seconds=args.seconds, fsync=args.fsync, root=root)
                for name in order
            }
            ratios.append(got["after"][0] / got["before"][0])
            cells = " | ".join(
                f"{name} {rate:,.0f}/s broker {broker:.1f} us client {client:.1f} us"
                for name, (rate, broker, client) in got.items()
            )
            print(f"round {number + 1} ({order[0]} first): {cells} | after/before {ratios[-1]:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"median after/before {statistics.median(ratios):.3f} over {len(ratios)} rounds "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); load at end {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
