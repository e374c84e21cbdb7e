"""Soak under hostile load: parked long polls and slow-header connections beside producers.

    .venv/bin/python bench/soak_hostile.py [--seconds 60] [--parked 20000] [--slow-headers 2000]
        [--producers 8] [--rounds 2]

One broker (the CLI users run, caps raised to fit the attack) serves every run. Each round
runs the producers twice, alone ("quiet") and beside the attackers ("hostile"), the order
alternating from round to round so that drift hits both alike; the ratios are per round.

- parked polls: ``--parked`` connections (raw asyncio sockets, in ``--attack-procs``
  processes) each long-polling a subject nothing is produced to, re-asking when answered;
- slow headers: ``--slow-headers`` connections each sending a request head one byte every
  ``--slow-interval`` seconds, never finishing it, reconnecting when the broker cuts it off;
- producers: ``--producers`` closed loops with the project's ``AsyncBrokerClient``,
  batches of ``--batch`` messages of ``--body-bytes``; throughput and p99 latency.

Broker RSS is taken before the attack, once the attackers are in place, at its peak while
the producers run, and after the attackers have gone (``--settle`` seconds later). Producers
add stored messages (and their dedup entries) to RSS too: the quiet runs' growth is shown
beside it. Every attacker loop is bounded by time and stops by itself; all traffic goes to
loopback addresses (the attackers use 127.0.0.2 and up as source addresses, each with its
own ephemeral ports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._broker import BenchBroker
from qmq_broker.http.connections import FD_RESERVE
from qmq_outbox.client import AsyncBrokerClient
from qmq_outbox.envelope import OutgoingMessage

QUIET_SUBJECT = "soak.quiet"  # nothing is produced here: polls on it stay parked
BUSY_SUBJECT = "soak.orders"
POLLS_PER_GROUP = 1000
CONNECTS_AT_ONCE = 256  # per attacker process, so the listen backlog never overflows


def raise_open_files() -> int:
    """Raise this process's soft open-file limit to the hard one (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard if hard != resource.RLIM_INFINITY else 1 << 20


# --- attackers (each runs in its own process: `soak_hostile.py --attack KIND ...`) -----------


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers


def _pull_request(index: int, wait_ms: int) -> bytes:
    body = orjson.dumps(
        {
            "subject": QUIET_SUBJECT,
            "group": f"idle-{index // POLLS_PER_GROUP}",
            "consumer": f"idle-{index}",
            "max": 1,
            "wait_ms": wait_ms,
        }
    )
    head = (
        "POST /v1/pull HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _parked_poll(
    index: int, port: int, source: str, until: float, gate: asyncio.Semaphore, stats: Counter[str]
) -> None:
    while time.time() < until:
        try:
            async with gate:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(source, 0)
                )
        except OSError:
            stats["connect_failed"] += 1
            await asyncio.sleep(1)
            continue
        stats["connected"] += 1
        try:
            while time.time() < until:
                wait_ms = int(min(60.0, max(until - time.time(), 0.1)) * 1000)
                writer.write(_pull_request(index, wait_ms))
                status, headers = await _read_response(reader)
                stats[f"status_{status}"] += 1
                if status != 200:
                    await asyncio.sleep(float(headers.get("retry-after", "1")))
                if headers.get("connection") == "close":
                    break
        except (OSError, asyncio.IncompleteReadError):
            stats["dropped"] += 1
        finally:
            writer.close()


async def _slow_header(
    port: int, source: str, interval: float, until: float, stats: Counter[str]
) -> None:
    partial = b"POST /v1/pull HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100_000
    while time.time() < until:
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
        except OSError:
            stats["connect_failed"] += 1
            await asyncio.sleep(1)
            continue
        stats["connected"] += 1
        try:
            for offset in range(len(partial)):
                if time.time() >= until:
                    break
                writer.write(partial[offset : offset + 1])
                try:
                    data = await asyncio.wait_for(reader.read(1024), interval)
                except TimeoutError:
                    continue
                stats["refused" if data.startswith(b"HTTP/1.1 503") else "cut_off"] += 1
                break
        except OSError:
            stats["cut_off"] += 1
        finally:
            writer.close()


async def _attack(kind: str, args: argparse.Namespace) -> Counter[str]:
    """Run until ``--until`` or until stdin closes (the soak says stop), whichever is first."""
    stats: Counter[str] = Counter()
    gate = asyncio.Semaphore(CONNECTS_AT_ONCE)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    threading.Thread(
        target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True
    ).start()
    if kind == "parked":
        tasks = [
            _parked_poll(i, args.port, args.source, args.until, gate, stats)
            for i in range(args.first, args.first + args.count)
        ]
    else:
        tasks = [
            _slow_header(args.port, args.source, args.slow_interval, args.until, stats)
            for _ in range(args.count)
        ]
    running = [asyncio.ensure_future(task) for task in tasks]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=max(args.until - time.time(), 0))
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    return stats


def attacker_main(args: argparse.Namespace) -> None:
    raise_open_files()
    stats = asyncio.run(_attack(args.attack, args))
    print(json.dumps({"kind": args.attack, "source": args.source, **stats}), flush=True)


# --- producers ----------------------------------------------------------------------------


@dataclass
class ProduceRun:
    seconds: float
    messages: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def p99_ms(self) -> float:
        if len(self.latencies) < 100:
            return float("nan")
        return statistics.quantiles(self.latencies, n=100)[98] * 1000


async def produce_for(url: str, args: argparse.Namespace, run_name: str) -> ProduceRun:
    run = ProduceRun(seconds=args.seconds)
    body = b"x" * args.body_bytes
    stop_at = time.monotonic() + args.seconds

    async def worker(client: AsyncBrokerClient, worker_id: int) -> None:
        sent = 0
        while time.monotonic() < stop_at:
            batch = [
                OutgoingMessage(
                    id=f"{run_name}-{worker_id}-{sent + n}", subject=BUSY_SUBJECT, body=body
                )
                for n in range(args.batch)
            ]
            began = time.perf_counter()
            try:
                await client.produce(batch)
            except Exception:  # counted: a refused or failed produce
                run.errors += 1
                await asyncio.sleep(0.1)
                continue
            run.latencies.append(time.perf_counter() - began)
            run.messages += len(batch)
            sent += len(batch)

    async with AsyncBrokerClient(url, max_connections=args.producers, timeout=30) as client:
        began = time.monotonic()
        await asyncio.gather(*(worker(client, i) for i in range(args.producers)))
        run.seconds = time.monotonic() - began
    return run


# --- the broker side ----------------------------------------------------------------------


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(condition: object, timeout: float) -> bool:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


class RssSampler:
    """The broker's RSS every half second while running: the peak of a window."""

    def __init__(self, broker: BenchBroker) -> None:
        self._broker = broker
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self._broker.rss_mb())


def start_attackers(
    args: argparse.Namespace, port: int, until: float
) -> list[subprocess.Popen[str]]:
    procs = []
    base = [sys.executable, __file__, "--port", str(port), "--until", str(until)]
    share = -(-args.parked // args.attack_procs)
    for n in range(args.attack_procs):
        first, count = n * share, min(share, args.parked - n * share)
        if count > 0:
            cmd = [*base, "--attack", "parked", "--first", str(first), "--count", str(count)]
            procs.append(_spawn([*cmd, "--source", f"127.0.0.{n + 2}"]))
    if args.slow_headers:
        cmd = [*base, "--attack", "slow", "--count", str(args.slow_headers)]
        cmd += ["--slow-interval", str(args.slow_interval)]
        procs.append(_spawn([*cmd, "--source", f"127.0.0.{args.attack_procs + 2}"]))
    return procs


def _spawn(cmd: list[str]) -> subprocess.Popen[str]:
    # closing its stdin tells an attacker to stop; --until bounds it if this process dies
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@dataclass
class HostileRun:
    produced: ProduceRun
    rss_before: float
    rss_attacked: float
    rss_peak: float
    rss_after: float
    parked_reached: float
    attackers: list[dict[str, object]]
    broker_counts: dict[str, float]


def hostile_run(broker: BenchBroker, args: argparse.Namespace, name: str) -> HostileRun:
    url = broker.url
    counted = ("connections_refused", "connections_timed_out", "pulls_refused")
    counts_before = {name: metric(url, f"qmq_broker_{name}_total") for name in counted}
    rss_before = broker.rss_mb()
    setup_s = args.setup_timeout
    until = time.time() + setup_s + args.seconds
    procs = start_attackers(args, broker.port, until)
    with RssSampler(broker) as sampler:
        wait_until(lambda: metric(url, "qmq_broker_pulls_parked") >= args.parked, setup_s)
        parked = metric(url, "qmq_broker_pulls_parked")
        rss_attacked = broker.rss_mb()
        produced = asyncio.run(produce_for(url, args, name))
    reports: list[dict[str, object]] = []
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()  # all stop at once
    for proc in procs:
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.wait(60)
        reports.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    wait_until(
        lambda: (
            metric(url, "qmq_broker_pulls_pending") == 0
            and metric(url, "qmq_broker_connections_open") <= 1
        ),
        60,
    )
    time.sleep(args.settle)
    counts = {
        name: metric(url, f"qmq_broker_{name}_total") - counts_before[name] for name in counted
    }
    return HostileRun(
        produced=produced,
        rss_before=rss_before,
        rss_attacked=rss_attacked,
        rss_peak=sampler.peak,
        rss_after=broker.rss_mb(),
        parked_reached=parked,
        attackers=reports,
        broker_counts=counts,
    )


def fit_to_box(args: argparse.Namespace) -> int:
    """The broker's connection cap this box allows; lowers ``--parked`` if it must."""
    limit = raise_open_files()
    wanted: int = args.parked + args.slow_headers + args.producers + 64
    cap: int = min(wanted, limit - FD_RESERVE)
    if cap < wanted:
        fitted = max(cap - args.slow_headers - args.producers - 64, 0)
        print(
            f"note: open files are limited to {limit} here (hard limit); the broker keeps "
            f"{FD_RESERVE} for itself, so --parked is lowered from {args.parked} to {fitted}",
            file=sys.stderr,
        )
        args.parked = fitted
    return cap


@dataclass
class Round:
    quiet: ProduceRun
    quiet_growth_mb: float  # RSS growth of the quiet run: stored messages, dedup entries
    hostile: HostileRun


def run_round(broker: BenchBroker, args: argparse.Namespace, round_no: int) -> Round:
    order = ("quiet", "hostile") if round_no % 2 == 0 else ("hostile", "quiet")
    quiet: tuple[ProduceRun, float] | None = None
    hostile: HostileRun | None = None
    for kind in order:
        name = f"r{round_no}-{kind}"
        if kind == "quiet":
            before = broker.rss_mb()
            run = asyncio.run(produce_for(broker.url, args, name))
            quiet = (run, broker.rss_mb() - before)
        else:
            hostile = hostile_run(broker, args, name)
        print(f"{name} done", file=sys.stderr)
    assert quiet is not None
    assert hostile is not None
    return Round(quiet=quiet[0], quiet_growth_mb=quiet[1], hostile=hostile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--parked", type=int, default=20_000)
    parser.add_argument("--slow-headers", type=int, default=2_000)
    parser.add_argument("--slow-interval", type=float, default=1.0)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--body-bytes", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--attack-procs", type=int, default=4)
    parser.add_argument("--settle", type=float, default=10, help="seconds before RSS after")
    parser.add_argument("--setup-timeout", type=float, default=60)
    parser.add_argument("--broker-arg", action="append", default=[], help="extra broker flag")
    # attacker processes
    parser.add_argument("--attack", choices=("parked", "slow"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--source", default="127.0.0.2", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        attacker_main(args)
        return
    cap = fit_to_box(args)
    broker_args = [
        "--max-connections", str(cap),
        "--max-pending-pulls", str(args.parked + 100),
        "--mailbox-size", str(POLLS_PER_GROUP + 100),
        *args.broker_arg,
    ]  # fmt: skip
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=os.environ.get("QMQ_BENCH_DIR")) as tmp:
        broker = BenchBroker(Path(tmp) / "data", *broker_args)
        broker.start()
        try:
            rss_start = broker.rss_mb()
            rounds = [run_round(broker, args, n) for n in range(args.rounds)]
            report(rounds, rss_start, args)
        finally:
            broker.stop()


def report(rounds: list[Round], rss_start: float, args: argparse.Namespace) -> None:
    print(f"\nbroker RSS at start: {rss_start:.0f} MB; load average now {os.getloadavg()}")
    print(
        f"{args.producers} producers x batches of {args.batch} x {args.body_bytes} B, "
        f"{args.seconds:g} s a run; attack: {args.parked} parked polls, "
        f"{args.slow_headers} slow-header connections (1 byte / {args.slow_interval:g} s)\n"
    )
    header = (
        "round | quiet msgs/s | hostile msgs/s | ratio | quiet p99 ms | hostile p99 ms | ratio"
        " | errors q/h"
    )
    print(header)
    print("-" * len(header))
    for n, one in enumerate(rounds):
        quiet, hostile = one.quiet, one.hostile.produced
        print(
            f"{n} | {quiet.rate:,.0f} | {hostile.rate:,.0f} | {hostile.rate / quiet.rate:.2f} | "
            f"{quiet.p99_ms:.1f} | {hostile.p99_ms:.1f} | {hostile.p99_ms / quiet.p99_ms:.2f} | "
            f"{quiet.errors}/{hostile.errors}"
        )
    print("\nround | broker RSS MB: before / attackers in place / peak / after | quiet-run growth")
    for n, one in enumerate(rounds):
        h = one.hostile
        print(
            f"{n} | {h.rss_before:.0f} / {h.rss_attacked:.0f} / {h.rss_peak:.0f} / "
            f"{h.rss_after:.0f} | {one.quiet_growth_mb:+.0f}"
        )
        print(f"  parked polls reached: {h.parked_reached:.0f}; broker: {h.broker_counts}")
        for attacker in h.attackers:
            print(f"  attacker {attacker}")


if __name__ == "__main__":
    main()
