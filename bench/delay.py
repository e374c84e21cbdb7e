"""Delayed messages: broker memory with many scheduled, and lateness when many come due.

Two parts, each on a fresh broker subprocess started with the ``qmq broker`` CLI and driven
with the project's own ``AsyncBrokerClient``:

``rss``       schedule N messages (default 1,000,000) spread evenly over the next H hours
              (default 24) and read the broker's VmRSS / VmHWM from /proc; then restart it
              (recovery rescans the schedule log) and read them again. Target: RSS <= 200 MB.
``lateness``  schedule M messages (default 100,000) due evenly within one minute that starts
              after all are accepted, with consumers waiting in long polls; lateness is
              the time a consumer received a message minus its deliver_at (also reported:
              the broker's stored_at minus deliver_at). Target: p99 <= 600 ms.
``burst``     (extra, not a target) M messages all due at the same instant.

    .venv/bin/python bench/delay.py                  # rss + lateness
    .venv/bin/python bench/delay.py --part burst --due-messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._broker import BenchBroker
from qmq_outbox.client import AsyncBrokerClient

SUBJECT = "bench.delay"
BODY = '{"order_id": 123456789, "action": "cancel-unpaid", "note": "' + "x" * 80 + '"}'


def stamp(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


# --- producing ------------------------------------------------------------------------------


async def schedule(
    url: str, dues: list[datetime], *, prefix: str, batch: int = 1000, concurrency: int = 4
) -> float:
    """Produce one message per due time; returns the seconds it took."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for start in range(0, len(dues), batch):
        queue.put_nowait(start)

    async def worker(client: AsyncBrokerClient) -> None:
        while not queue.empty():
            start = queue.get_nowait()
            messages = [
                {
                    "id": f"{prefix}-{i}",
                    "subject": SUBJECT,
                    "body": BODY,
                    "deliver_at": stamp(dues[i]),
                }
                for i in range(start, min(start + batch, len(dues)))
            ]
            results = await client.produce_raw(orjson.dumps({"messages": messages}))
            if any(r.status != "scheduled" for r in results):
                raise RuntimeError(f"not all scheduled: {results[0]}")

    began = time.perf_counter()
    async with AsyncBrokerClient(url, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return time.perf_counter() - began


# --- part 1: memory -------------------------------------------------------------------------


async def part_rss(work: Path, messages: int, hours: float) -> dict[str, Any]:
    broker = BenchBroker(work / "rss", "--log-level", "WARNING")
    broker.start(timeout=300)
    try:
        idle = broker.memory_mb()
        now = datetime.now(UTC)
        span = hours * 3600
        dues = [now + timedelta(seconds=60 + span * i / messages) for i in range(messages)]
        seconds = await schedule(broker.url, dues, prefix="r")
        loaded = broker.memory_mb()
        async with httpx.AsyncClient(base_url=broker.url) as http:
            doc = (await http.get("/v1/schedule", params={"limit": 100})).json()
        broker.stop()
        recovery_s = broker.start(timeout=300)
        restarted = broker.memory_mb()
        async with httpx.AsyncClient(base_url=broker.url) as http:
            after = (await http.get("/v1/schedule", params={"limit": 100})).json()
    finally:
        broker.stop()
    disk = sum(f.stat().st_size for f in (work / "rss" / "schedule").iterdir())
    return {
        "messages": messages,
        "hours": hours,
        "produce_seconds": round(seconds, 1),
        "produce_rate": round(messages / seconds),
        "rss_idle_mb": round(idle["VmRSS"], 1),
        "rss_after_scheduling_mb": round(loaded["VmRSS"], 1),
        "hwm_while_scheduling_mb": round(loaded["VmHWM"], 1),
        "pending_reported": doc["messages"],
        "hours_reported": len(doc["hours"]),
        "wheel_messages": doc["wheel_messages"],
        "restart_recovery_seconds": round(recovery_s, 2),
        "rss_after_restart_mb": round(restarted["VmRSS"], 1),
        "hwm_after_restart_mb": round(restarted["VmHWM"], 1),
        "pending_after_restart": after["messages"],
        "schedule_log_mb": round(disk / 2**20, 1),
    }


# --- part 2: lateness -----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def consume(
    url: str, count: int, consumers: int, deadline: float
) -> list[tuple[float, str, str | None]]:
    """(received wall time, id, stored_at) of every message, pulled by ``consumers``."""
    received: list[tuple[float, str, str | None]] = []

    async def one(name: str) -> None:
        async with AsyncBrokerClient(url, timeout=60) as client:
            while len(received) < count and time.time() < deadline:
                got = await client.pull(SUBJECT, "bench", name, max_messages=1000, wait_ms=1000)
                now = time.time()
                for m in got:
                    received.append((now, m.id, stamp(m.stored_at) if m.stored_at else None))
                if got:
                    await client.ack(SUBJECT, "bench", name, [m.seq for m in got])

    await asyncio.gather(*(one(f"c{i}") for i in range(consumers)))
    return received


async def part_lateness(
    work: Path, messages: int, window_s: float, *, name: str, consumers: int
) -> dict[str, Any]:
    broker = BenchBroker(work / name, "--log-level", "WARNING")
    broker.start(timeout=300)
    try:
        lead = 15 + messages / 10_000  # enough to accept everything before the first is due
        first = datetime.now(UTC) + timedelta(seconds=lead)
        dues = [first + timedelta(seconds=window_s * i / messages) for i in range(messages)]
        due_of = {f"l-{i}": due.timestamp() for i, due in enumerate(dues)}
        seconds = await schedule(broker.url, dues, prefix="l")
        if datetime.now(UTC) >= first:
            raise RuntimeError("scheduling took longer than the lead time; raise it")
        deadline = first.timestamp() + window_s + 120
        received = await consume(broker.url, messages, consumers, deadline)
        peak = broker.memory_mb()
        async with httpx.AsyncClient(base_url=broker.url) as http:
            metrics = (await http.get("/metrics")).text
    finally:
        broker.stop()
    ids = [r[1] for r in received]
    consumer_late = [(t - due_of[i]) * 1000 for t, i, _ in received]
    stored_late = [
        (datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() - due_of[i]) * 1000
        for _, i, s in received
        if s is not None
    ]
    return {
        "messages": messages,
        "window_seconds": window_s,
        "consumers": consumers,
        "produce_seconds": round(seconds, 1),
        "received": len(received),
        "distinct": len(set(ids)),
        "early": sum(1 for x in stored_late if x < 0),
        "consumer_lateness_ms": summary(consumer_late),
        "stored_lateness_ms": summary(stored_late),
        "broker_hwm_mb": round(peak["VmHWM"], 1),
        "redispatched": next(
            (
                line.split()[-1]
                for line in metrics.splitlines()
                if line.startswith("qmq_broker_schedule_redispatched_messages_total")
            ),
            "?",
        ),
    }


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50": round(percentile(values, 0.50), 1),
        "p90": round(percentile(values, 0.90), 1),
        "p99": round(percentile(values, 0.99), 1),
        "max": round(max(values), 1),
        "min": round(min(values), 1),
    }


# --- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["all", "rss", "lateness", "burst"], default="all")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--due-messages", type=int, default=100_000)
    parser.add_argument("--window", type=float, default=60.0, help="seconds the due times span")
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="qmq-bench-delay-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} vCPU, {platform.python_implementation()} "
        f"{platform.python_version()}, {platform.system()} {platform.release()}",
    }
    if args.part in ("all", "rss"):
        report["rss"] = asyncio.run(part_rss(work, args.messages, args.hours))
        print(orjson.dumps(report["rss"]).decode(), flush=True)
    if args.part in ("all", "lateness"):
        report["lateness"] = asyncio.run(
            part_lateness(
                work, args.due_messages, args.window, name="lateness", consumers=args.consumers
            )
        )
        print(orjson.dumps(report["lateness"]).decode(), flush=True)
    if args.part == "burst":
        report["burst"] = asyncio.run(
            part_lateness(work, args.due_messages, 0.0, name="burst", consumers=args.consumers)
        )
        print(orjson.dumps(report["burst"]).decode(), flush=True)
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
