"""The qmq broker side by side with the queues a team would use instead (issue 14).

    .venv/bin/python bench/peers.py [--rounds 3] [--seconds 10] [--json results.json]

Four workloads, 1 KiB bodies, on every system: durable produce (8 connections, batches of
100), pull + ack (batches of 100), single-message produce latency, and end-to-end latency at
1,000 msg/s offered. The systems: the qmq broker (`--fsync always`, started here, driven by
the project's `AsyncBrokerClient`), a PostgreSQL table queue (a database of its own,
created and dropped here), RabbitMQ classic and quorum queues (aio-pika, confirms) and NATS
JetStream (nats-py). Rounds interleave the systems in a rotated order so that drift hits
them alike; the output is Markdown tables (medians, per-round qmq / peer ratios, CPU per
message) for docs/benchmarks.md, and with --json every sample.

Smoke run (under a minute): --seconds 2 --rounds 1 --consume-messages 2000 --single-count 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._cli import positive, positive_float
from bench._peers.common import Peer, rotated
from bench._peers.report import Report, Sample
from bench._peers.workloads import WORKLOADS, Result, Settings
from bench._speed import python_speed

T = TypeVar("T")

SYSTEMS = ("qmq", "qmq-pair", "floor", "postgres", "rabbitmq-classic", "rabbitmq-quorum", "nats")
OPT_IN = ("qmq-pair", "floor")  # run only when asked for


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--rounds", type=positive, default=3, help="rounds of every workload on every system"
    )
    parser.add_argument(
        "--seconds",
        type=positive_float,
        default=10,
        help="length of durable produce and of end to end",
    )
    parser.add_argument(
        "--consume-messages", type=positive, default=50_000, help="backlog pull + ack drains"
    )
    parser.add_argument(
        "--single-count", type=positive, default=2000, help="single-message produces timed"
    )
    parser.add_argument(
        "--rate", type=positive_float, default=1000, help="end to end: msg/s offered"
    )
    parser.add_argument(
        "--connections", type=positive, default=8, help="producers of durable produce"
    )
    parser.add_argument(
        "--batch", type=positive, default=100, help="messages per produce and per pull"
    )
    parser.add_argument("--consumers", type=positive, default=4, help="consumers of pull + ack")
    parser.add_argument(
        "--senders", type=positive, default=8, help="end to end: producer connections"
    )
    parser.add_argument(
        "--systems",
        default=",".join(name for name in SYSTEMS if name not in OPT_IN),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (qmq-pair: two independent"
        " brokers sharing the load, the ceiling of splitting one over both cores; floor: the"
        " least a durable broker does per message on the qmq broker's server stack)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--pg-url",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a database to run CREATE/DROP DATABASE from",
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--json", type=Path, help="write every sample and the medians here")
    args = parser.parse_args()
    for option, known in (("systems", SYSTEMS), ("workloads", tuple(WORKLOADS))):
        unknown = set(getattr(args, option).split(",")) - set(known)
        if unknown:
            parser.error(f"--{option}: unknown {', '.join(sorted(unknown))}")
    return args


def build_peers(args: argparse.Namespace, data_root: Path) -> list[Peer]:
    # imported here so that a run without a peer does not need its client library
    chosen = args.systems.split(",")
    peers: list[Peer] = []
    for name in SYSTEMS:
        if name not in chosen:
            continue
        if name.startswith("qmq"):
            from bench._peers.qmq import QmqPeer

            peers.append(QmqPeer(data_root=data_root, brokers=2 if name == "qmq-pair" else 1))
        elif name == "floor":
            from bench._peers.floor import FloorPeer

            peers.append(FloorPeer(data_root=data_root))
        elif name == "postgres":
            from bench._peers.postgres import PostgresPeer

            peers.append(PostgresPeer(admin_url=args.pg_url))
        elif name.startswith("rabbitmq"):
            from bench._peers.rabbitmq import RabbitPeer

            peers.append(RabbitPeer(url=args.amqp_url, quorum=name.endswith("quorum")))
        else:
            from bench._peers.nats import NatsPeer

            peers.append(NatsPeer(url=args.nats_url))
    return peers


async def run_rounds(
    peers: list[Peer], settings: Settings, rounds: int, workloads: list[str]
) -> list[Sample]:
    samples: list[Sample] = []
    started: list[Peer] = []
    try:
        for peer in peers:
            await peer.start()
            started.append(peer)
            if not peer.server_processes():
                print(f"{peer.name}: no server process found, server CPU reads 0", file=sys.stderr)
        for round_ in range(1, rounds + 1):
            for workload in workloads:
                for peer in rotated(peers, round_ - 1):
                    await peer.reset()
                    result = await WORKLOADS[workload](peer, settings)
                    samples.append(
                        Sample(round=round_, workload=workload, system=peer.name, result=result)
                    )
                    print(progress(round_, workload, peer.name, result), file=sys.stderr)
    finally:
        for peer in reversed(started):
            try:
                await peer.stop()
            except Exception as exc:  # report and go on stopping the others
                print(f"{peer.name}: stop failed: {exc!r}", file=sys.stderr)
    return samples


async def stoppable(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` so that SIGTERM cancels it like Ctrl-C does: the peers still stop
    (the database is dropped, the queue and the stream deleted)."""
    task = asyncio.ensure_future(work)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def progress(round_: int, workload: str, system: str, result: Result) -> str:
    figure = (
        f"{result.rate:>9,.0f} msg/s"
        if result.p50_ms is None or result.p99_ms is None
        else f"p50 {result.p50_ms:7.2f} ms, p99 {result.p99_ms:7.2f} ms"
    )
    lost = f", {result.lost} LOST" if result.lost else ""
    return (
        f"round {round_} {workload:<8} {system:<17} {figure}{lost}; CPU per message: client"
        f" {result.client_us:.1f} µs, server {result.server_us:.1f} µs"
    )


def markdown(report: Report, notes: list[str], header: str) -> str:
    lines = [header, "", *report.medians_table(), ""]
    ratios = report.ratios_table()
    if ratios:
        lines += [
            "qmq / peer per round (throughput: above 1 is qmq faster; latency p50 / p99: below 1"
            " is qmq faster):",
            "",
            *ratios,
            "",
        ]
    lines += [
        "CPU per message, µs, client / server (median of the rounds). Client: this process"
        " (`time.process_time`), i.e. each system's Python client. Server, approximate"
        " (psutil, user + system in 10 ms clock ticks, read at both ends of the measured"
        " stretch, so short runs give coarse figures): the broker"
        " process and its children; the postmaster, its auxiliary processes and this"
        " database's backends; every `beam.smp`; every `nats-server`.",
        "",
        *report.cpu_table(),
        "",
        *(f"- {note}" for note in notes),
    ]
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no NaN: a missing figure is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def main() -> None:
    args = parse_args()
    settings = Settings(
        seconds=args.seconds,
        connections=args.connections,
        batch=args.batch,
        consumers=args.consumers,
        consume_messages=args.consume_messages,
        single_count=args.single_count,
        rate=args.rate,
        senders=args.senders,
    )
    load_start = os.getloadavg()
    began = time.gmtime()
    with tempfile.TemporaryDirectory(dir=os.environ.get("QMQ_BENCH_DIR")) as tmp:
        peers = build_peers(args, Path(tmp))
        try:
            samples = asyncio.run(
                stoppable(run_rounds(peers, settings, args.rounds, args.workloads.split(",")))
            )
        except (asyncio.CancelledError, KeyboardInterrupt):
            sys.exit("interrupted: the peers were stopped and cleaned up; no report")
        notes = [note for peer in peers for note in peer.notes()]
    load_end = os.getloadavg()
    speed = python_speed()
    command = "python bench/peers.py " + shlex.join(sys.argv[1:])
    header = (
        f"`{command.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', began)},"
        f" {platform.node()}: {os.cpu_count()} vCPU, Python {platform.python_version()};"
        f" load average (1 / 5 / 15 min) {_load(load_start)} at the start,"
        f" {_load(load_end)} at the end; {speed}. {args.rounds} round(s), each running every system"
        " once per workload, the order of the systems rotated by one each round."
    )
    report = Report(samples=samples, systems=[(p.name, p.title) for p in peers], settings=settings)
    print(markdown(report, notes, header))
    if args.json:
        document = report.as_json() | {
            "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", began),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_start": load_start,
            "load_average_end": load_end,
            "notes": notes,
        }
        args.json.write_text(json.dumps(_finite(document), indent=2) + "\n")


def _load(values: tuple[float, float, float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    main()
