"""Fair pull scheduling: skewed groups and slow-group isolation, ``fair`` vs ``fifo``.

    .venv/bin/python bench/fairness.py [--seconds 20] [--repeat 2] [--client c|python]

1. Skewed groups. One subject with a large backlog; group A runs 100 consumers and group
   B runs 2, every consumer pulling (``wait_ms=0``, no acks) in a loop as fast as the broker
   answers. Reported: messages delivered per group in the measurement window, B's share
   and Jain's fairness index over the two groups.
2. Slow-group isolation. Group C (8 consumers) reads a cold backlog: every pull read of C
   waits ``--cold-read-ms`` (the broker's hidden ``--debug-read-delay-ms``, standing in for
   a disk: on the event loop while the broker reads ahead, on a read thread with
   ``--readahead-wait-ms 0``); group D (2 consumers) pulls hot, recently written messages.
   Reported: D's pull latency alone and with C running, and C's rate.

Both schedulers run in the same invocation, on the same data directory, with the default
``--workers`` and ``--time-slice-ms``, ``--repeat`` rounds of fair then fifo (the machine
is shared; the rounds show the spread). D alone and D with C alternate ``--phases`` times
so that drifts of the shared machine's load hit both conditions alike.

The server must be the bottleneck, not the load generator. The default generator,
``--client c``, is ``bench/pullgen.c`` (compiled here with gcc): one process per group,
one keep-alive connection per consumer, messages counted without parsing the JSON; it
costs a few percent of the broker's CPU. ``--client python`` runs the consumers as asyncio
tasks over the project's ``AsyncBrokerClient`` (one connection each, one process per
group); that consumer spends about as much CPU per pull as the broker (it builds a
``Message`` per message), so a group with few consumers is limited by its own round trip.
Each run reports CPU time / wall time of the broker and of each generator process over
the measurement window.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._broker import BenchBroker
from bench._speed import python_speed
from qmq_outbox.client import AsyncBrokerClient
from qmq_outbox.errors import BrokerUnavailable

BODY = "x" * 100
WARMUP_S = 3.0


# --- load generator (runs in its own process) -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupLoad:
    subject: str
    group: str
    consumers: int
    batch: int


def consume(load: GroupLoad, url: str, ready: Any, go: Any, window: Any, out: Any) -> None:
    """Process entry: ``load.consumers`` asyncio consumers, one connection each.

    Says ``ready`` once its clients exist, starts on ``go`` and counts only the pulls that
    complete inside the window the orchestrator set (shared ``begin, end``).
    """
    out.put(asyncio.run(_consume(load, url, ready, go, window)))


async def _consume(load: GroupLoad, url: str, ready: Any, go: Any, window: Any) -> dict[str, Any]:
    # one client (one connection) per consumer, as separate consumer processes would have;
    # a single httpx pool shared by 100 busy tasks costs the generator more CPU than it saves
    clients = [AsyncBrokerClient(url, max_connections=1, timeout=60) for _ in range(load.consumers)]
    ready.put(load.group)
    await asyncio.to_thread(go.wait)
    begin, end = window[0], window[1]
    delivered = 0
    pulls = 0
    errors = 0
    latencies: list[float] = []
    cpu_at: dict[str, float] = {}

    async def consumer(client: AsyncBrokerClient, name: str) -> None:
        nonlocal delivered, pulls, errors
        while time.time() < end:
            began = time.perf_counter()
            try:
                messages = await client.pull(
                    load.subject, load.group, name, max_messages=load.batch, wait_ms=0
                )
            except BrokerUnavailable:
                errors += 1
                await asyncio.sleep(0.01)
                continue
            took = time.perf_counter() - began
            if begin <= time.time() < end:
                delivered += len(messages)
                pulls += 1
                latencies.append(took)
            if not messages:
                await asyncio.sleep(0.005)  # backlog exhausted: should not happen

    async def cpu_marks() -> None:
        await asyncio.sleep(max(begin - time.time(), 0))
        cpu_at["begin"] = time.process_time()
        await asyncio.sleep(max(end - time.time(), 0))
        cpu_at["end"] = time.process_time()

    try:
        marks = asyncio.create_task(cpu_marks())
        await asyncio.gather(
            *(consumer(client, f"{load.group}-{n}") for n, client in enumerate(clients))
        )
        await marks
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))
    latencies.sort()
    return {
        "group": load.group,
        "consumers": load.consumers,
        "delivered": delivered,
        "pulls": pulls,
        "errors": errors,
        "cpu_share": (cpu_at["end"] - cpu_at["begin"]) / (end - begin),
        "p50_ms": 1000 * _quantile(latencies, 0.50),
        "p99_ms": 1000 * _quantile(latencies, 0.99),
        "latencies": latencies,
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(int(q * len(values)), len(values) - 1)]


def run_loads(
    broker: BenchBroker, loads: list[GroupLoad], seconds: float, pullgen: Path | None
) -> dict[str, Any]:
    """Run one load-generator process per group; per-group results and the broker's CPU.

    ``pullgen``: the compiled ``bench/pullgen.c``; without it, AsyncBrokerClient processes.
    """
    if pullgen is not None:
        return _run_pullgen(pullgen, broker, loads, seconds)
    ctx = multiprocessing.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    window = ctx.Array("d", [0.0, 0.0])
    procs = [
        ctx.Process(
            target=consume, args=(load, broker.url, ready, go, window, out), name=load.group
        )
        for load in loads
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=300)
    begin = time.time() + WARMUP_S  # the consumers start now; count from here
    end = begin + seconds
    window[0], window[1] = begin, end
    go.set()
    cpu = _broker_cpu(broker, begin, end)
    results = {r["group"]: r for r in (out.get(timeout=300) for _ in procs)}
    for proc in procs:
        proc.join(30)
    return {"groups": results, "broker_cpu_share": cpu}


def _run_pullgen(
    binary: Path, broker: BenchBroker, loads: list[GroupLoad], seconds: float
) -> dict[str, Any]:
    begin = time.time() + 0.5 + WARMUP_S
    end = begin + seconds
    procs = [
        subprocess.Popen(
            [
                str(binary),
                str(broker.port),
                load.subject,
                load.group,
                str(load.consumers),
                str(load.batch),
                repr(begin),
                repr(end),
            ],
            stdout=subprocess.PIPE,
        )
        for load in loads
    ]
    cpu = _broker_cpu(broker, begin, end)
    results = {}
    for proc in procs:
        stdout, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"pullgen exited with {proc.returncode}")
        result = json.loads(stdout)
        results[result["group"]] = result
    return {"groups": results, "broker_cpu_share": cpu}


def _broker_cpu(broker: BenchBroker, begin: float, end: float) -> float:
    """CPU seconds per second the broker process used in [begin, end)."""
    time.sleep(max(begin - time.time(), 0))
    cpu_begin = broker.cpu_seconds()
    time.sleep(max(end - time.time(), 0))
    return (broker.cpu_seconds() - cpu_begin) / (end - begin)


def compile_pullgen(into: Path) -> Path:
    binary = into / "pullgen"
    source = Path(__file__).resolve().parent / "pullgen.c"
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(source)], check=True)
    return binary


# --- setup --------------------------------------------------------------------------------


async def fill(url: str, subject: str, count: int, *, batch: int = 1000) -> None:
    """Produce ``count`` messages with 100-byte bodies, four batches in flight."""
    import orjson

    async def worker(client: AsyncBrokerClient, starts: list[int]) -> None:
        for start in starts:
            doc = {
                "messages": [
                    {"id": f"{subject}-{n}", "subject": subject, "body": BODY}
                    for n in range(start, min(start + batch, count))
                ]
            }
            await client.produce_raw(orjson.dumps(doc))

    starts = list(range(0, count, batch))
    async with AsyncBrokerClient(url, max_connections=8, timeout=120) as client:
        await asyncio.gather(*(worker(client, starts[i::4]) for i in range(4)))


def jain(values: list[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else float("nan")


# --- scenarios ----------------------------------------------------------------------------


def skewed(
    data: Path, scheduler: str, label: str, batch: int, args: argparse.Namespace
) -> dict[str, Any]:
    broker = BenchBroker(data, "--scheduler", scheduler, "--fsync", "never", "--ack-timeout", "1h")
    broker.start()
    loads = [
        GroupLoad("skew", f"A-{label}", 100, batch),
        GroupLoad("skew", f"B-{label}", 2, batch),
    ]
    try:
        result = run_loads(broker, loads, args.seconds, args.pullgen)
        waits = mailbox_waits(broker.url)
    finally:
        broker.stop()
    for group in result["groups"].values():
        del group["latencies"]
    a, b = (result["groups"][load.group] for load in loads)
    result["b_share"] = b["delivered"] / max(a["delivered"] + b["delivered"], 1)
    result["jain"] = jain([a["delivered"], b["delivered"]])
    result["a"], result["b"] = a, b
    result["batch"] = batch
    result["a_wait_ms"], result["b_wait_ms"] = (waits.get(load.group, 0.0) for load in loads)
    return result


def mailbox_waits(url: str) -> dict[str, float]:
    """Mean time (ms) a pull waited in its group's mailbox, from the broker's metrics."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for suffix, into in (("_sum{", sums), ("_count{", counts)):
            if line.startswith("qmq_broker_actor_queue_wait_seconds" + suffix):
                group = line.split('group="', 1)[1].split('"', 1)[0]
                into[group] = float(line.rsplit(" ", 1)[1])
    return {g: 1000 * sums[g] / counts[g] for g in sums if counts.get(g)}


def isolation(data: Path, scheduler: str, label: str, args: argparse.Namespace) -> dict[str, Any]:
    """D alone and D beside C, alternated ``--phases`` times on one broker.

    Alternating the two conditions spreads the shared machine's load drift over both; the
    latencies of each condition are pooled before taking percentiles.
    """
    cold_group = f"C-{label}"
    wait = args.readahead_wait_ms
    readahead = () if wait is None else ("--readahead-wait-ms", wait)
    broker = BenchBroker(
        data,
        "--scheduler",
        scheduler,
        "--fsync",
        "never",
        "--ack-timeout",
        "1h",
        "--debug-read-delay-ms",
        f"cold:{cold_group}={args.cold_read_ms}",
        *readahead,
    )
    broker.start()
    window = args.seconds / args.phases
    alone: list[dict[str, Any]] = []
    beside: list[dict[str, Any]] = []
    cold: list[dict[str, Any]] = []
    try:
        for phase in range(args.phases):
            d_alone = GroupLoad("hot", f"D-{label}-alone-{phase}", 2, 32)
            alone.append(
                run_loads(broker, [d_alone], window, args.pullgen)["groups"][d_alone.group]
            )
            d_with = GroupLoad("hot", f"D-{label}-with-C-{phase}", 2, 32)
            loads = [d_with, GroupLoad("cold", cold_group, 8, 32)]
            both = run_loads(broker, loads, window, args.pullgen)
            beside.append(both["groups"][d_with.group])
            cold.append(both["groups"][cold_group])
    finally:
        broker.stop()
    result = {"d_alone": _pool(alone), "d_with": _pool(beside), "c": _pool(cold)}
    result["p99_ratio"] = result["d_with"]["p99_ms"] / result["d_alone"]["p99_ms"]
    return result


def _pool(parts: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = sorted(x for part in parts for x in part["latencies"])
    return {
        "delivered": sum(part["delivered"] for part in parts),
        "pulls": sum(part["pulls"] for part in parts),
        "p50_ms": 1000 * _quantile(latencies, 0.50),
        "p99_ms": 1000 * _quantile(latencies, 0.99),
    }


# --- report -------------------------------------------------------------------------------


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} vCPU, Python {platform.python_version()}, "
        f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}, {python_speed()}"
    )


def report(args: argparse.Namespace, skew: dict[str, Any], iso: dict[str, Any], **meta: str) -> str:
    lines = [
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine_before']} before, {meta['machine_after']} after.",
        "",
        f"**1. Skewed groups** (A: 100 consumers, B: 2; `max` per pull as given; "
        f"{args.seconds:.0f} s window after {WARMUP_S:.0f} s warm-up; no acks)",
        "",
        "| run | max | A msgs | B msgs | B share | Jain | mailbox wait A / B (mean ms) "
        "| pull p99 A / B (ms) | broker CPU | load gen CPU A, B |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in skew.items():
        a, b = r["a"], r["b"]
        lines.append(
            f"| {name} | {r['batch']} | {a['delivered']} | {b['delivered']} | {r['b_share']:.3f} "
            f"| {r['jain']:.3f} | {r['a_wait_ms']:.1f} / {r['b_wait_ms']:.1f} "
            f"| {a['p99_ms']:.0f} / {b['p99_ms']:.0f} "
            f"| {r['broker_cpu_share']:.2f} | {a['cpu_share']:.2f}, {b['cpu_share']:.2f} |"
        )
    lines += [
        "",
        f"**2. Slow-group isolation** (C: 8 consumers on a cold backlog, "
        f"{args.cold_read_ms} ms per read; D: 2 consumers on hot messages; batch 32; "
        f"{args.phases} alternations of D alone / D with C, {args.seconds:.0f} s of each)",
        "",
        "| run | D p50 alone | D p99 alone | D p50 with C | D p99 with C | p99 ratio "
        "| D msgs/s alone | D msgs/s with C | C msgs/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in iso.items():
        da, dw, c = r["d_alone"], r["d_with"], r["c"]
        lines.append(
            f"| {name} | {da['p50_ms']:.2f} ms | {da['p99_ms']:.2f} ms | {dw['p50_ms']:.2f} ms "
            f"| {dw['p99_ms']:.2f} ms | {r['p99_ratio']:.2f} "
            f"| {da['delivered'] / args.seconds:.0f} | {dw['delivered'] / args.seconds:.0f} "
            f"| {c['delivered'] / args.seconds:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window")
    parser.add_argument(
        "--batches",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 10, 32, 256],
        help="comma-separated max messages per pull of the skew runs (default: 1,10,32,256)",
    )
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--cold-read-ms", type=int, default=20)
    parser.add_argument(
        "--readahead-wait-ms",
        default=None,
        help="the broker's --readahead-wait-ms (isolation; default: the broker's). 0 reads "
        "C's cold records on read threads, as brokers before read-ahead did",
    )
    parser.add_argument("--only", choices=["skew", "isolation"], default=None)
    parser.add_argument("--repeat", type=int, default=2, help="rounds of fair then fifo")
    parser.add_argument("--phases", type=int, default=3, help="isolation: alternations")
    parser.add_argument(
        "--client",
        choices=["c", "python"],
        default="c",
        help="load generator: bench/pullgen.c (default) or AsyncBrokerClient tasks",
    )
    args = parser.parse_args()
    args.pullgen = None
    command = "python bench/fairness.py " + " ".join(sys.argv[1:])
    date = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
    before = machine()
    with tempfile.TemporaryDirectory(prefix="qmq-fairness-") as tmp:
        data = Path(tmp) / "data"
        if args.client == "c":
            args.pullgen = compile_pullgen(Path(tmp))
        filler = BenchBroker(data, "--fsync", "never")
        filler.start()
        try:
            began = time.monotonic()
            asyncio.run(fill(filler.url, "skew", args.backlog if args.only != "isolation" else 0))
            asyncio.run(fill(filler.url, "cold", 200_000 if args.only != "skew" else 0))
            asyncio.run(fill(filler.url, "hot", 400_000 if args.only != "skew" else 0))
            print(f"filled in {time.monotonic() - began:.0f} s", file=sys.stderr)
        finally:
            filler.stop()
        skew: dict[str, Any] = {}
        iso: dict[str, Any] = {}
        for round_ in range(1, args.repeat + 1):
            for scheduler in ("fair", "fifo"):
                label = f"{scheduler}-{round_}"
                if args.only != "isolation":
                    for batch in args.batches:
                        run = f"{label}-max{batch}"
                        skew[run] = skewed(data, scheduler, run, batch, args)
                        print(run, "skew", skew[run], file=sys.stderr)
                if args.only != "skew":
                    iso[label] = isolation(data, scheduler, label, args)
                    print(label, "isolation", iso[label], file=sys.stderr)
    print(
        report(
            args,
            skew,
            iso,
            command=command,
            date=date,
            machine_before=before,
            machine_after=machine(),
        )
    )


if __name__ == "__main__":
    main()
