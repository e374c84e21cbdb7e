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

``--single N`` adds, to each run after its throughput stretch, N produces of one message
each, one at a time on one connection (``broker_throughput.single_latency``): their p50 and
p99 and the broker's CPU per request, with the after / before ratio of the p50s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._broker import BenchBroker
from bench.broker_throughput import durable_produce, single_latency

HERE = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    rate: float  # messages/s
    broker_us: float  # broker CPU per message
    client_us: float  # this process's CPU per message
    single: tuple[float, float, float] | None  # p50 ms, p99 ms, broker CPU us per request


def one_run(checkout: Path, *, seconds: float, fsync: str, root: Path, single: int) -> Run:
    """Durable produce (and ``single`` one-message produces) on a fresh broker of
    ``checkout``."""
    broker = BenchBroker(
        Path(tempfile.mkdtemp(dir=root)) / "data", "--fsync", fsync, checkout=checkout
    )
    broker.start(timeout=60)
    try:
        cpu_before, client_before = broker.cpu_seconds(), time.process_time()
        rate, sent = asyncio.run(durable_produce(broker.url, seconds))
        broker_us = (broker.cpu_seconds() - cpu_before) / sent * 1e6
        client_us = (time.process_time() - client_before) / sent * 1e6
        timed = None
        if single:
            cpu_before = broker.cpu_seconds()
            latencies = sorted(asyncio.run(single_latency(broker.url, single)))
            per_request = (broker.cpu_seconds() - cpu_before) / single * 1e6
            p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
            timed = (p50 * 1000, p99 * 1000, per_request)
        return Run(rate, broker_us, client_us, timed)
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
    parser.add_argument("--single", type=int, default=0, help="one-message produces per run")
    args = parser.parse_args()
    builds = {"before": args.before.resolve(), "after": args.after.resolve()}
    root = Path(tempfile.mkdtemp(prefix="qmq-produce-ab-"))
    print(f"durable produce, 8 connections x 100 x 1 KiB, {args.seconds:g} s per run, "
          f"--fsync {args.fsync}; load at start {os.getloadavg()}")  # fmt: skip
    ratios: list[float] = []
    single_ratios: list[float] = []
    try:
        for number in range(args.rounds):
            order = ("before", "after") if number % 2 == 0 else ("after", "before")
            got = {
                name: one_run(
                    builds[name], seconds=args.seconds, fsync=args.fsync, root=root,
                    single=args.single,
                )
                for name in order
            }  # fmt: skip
            ratios.append(got["after"].rate / got["before"].rate)
            cells = " | ".join(
                f"{name} {run.rate:,.0f}/s broker {run.broker_us:.1f} us "
                f"client {run.client_us:.1f} us" + _single_cell(run)
                for name, run in got.items()
            )
            line = f"round {number + 1} ({order[0]} first): {cells} | after/before {ratios[-1]:.3f}"
            after_single, before_single = got["after"].single, got["before"].single
            if after_single is not None and before_single is not None:
                single_ratios.append(after_single[0] / before_single[0])
                line += f", single p50 {single_ratios[-1]:.3f}"
            print(line)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"median after/before {statistics.median(ratios):.3f} over {len(ratios)} rounds "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); load at end {os.getloadavg()}"
    )
    if single_ratios:
        print(
            f"single-message p50 after/before: median {statistics.median(single_ratios):.3f} "
            f"(min {min(single_ratios):.3f}, max {max(single_ratios):.3f}; below 1 is faster)"
        )


def _single_cell(run: Run) -> str:
    if run.single is None:
        return ""
    p50, p99, per_request = run.single
    return f", single p50 {p50:.3f} p99 {p99:.3f} ms broker {per_request:.0f} us/request"


if __name__ == "__main__":
    main()
