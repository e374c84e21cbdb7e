"""One run: a system on a fresh database, its processes started, the producers let go at
once, the window measured until every committed message's effect is written (the tax: until
the last transaction, and for the outbox until its dispatcher has sent every row), then
the exactly-once check."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench._flow.common import Database, Produced, fresh_database, processes
from bench._flow.producer import Plan, producer_main
from bench._flow.systems import system
from bench._peers.meter import cpu_snapshot, cpu_spent

MEASURES = ("throughput", "latency", "tax")
SETTLE = 0.5  # s between the worker's start and the window, and after the drain
LEAD = 0.3  # s from the go signal to the first transaction's slot
POLL = 0.05  # s between counts of the effects while waiting for the drain
WARMUP = 1.0  # s of a latency run's first commits left out of the percentiles


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    admin_url: str
    seconds: float
    producers: int  # transactions in flight at once, over all producer processes
    producer_processes: int
    rate: float  # latency: transactions per second offered
    drain_timeout: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    measure: str
    system: str
    round: int
    load: tuple[float, float, float]  # 1 / 5 / 15 min load average at the run's start
    committed: int
    rolled_back: int
    late: int
    seconds: float  # first slot -> last transaction ended
    drained_seconds: float  # first slot -> last effect written (tax: last row sent)
    cpu: dict[str, float]  # role -> CPU seconds over the window
    caller_cpu: float  # of the producers' CPU, the transaction threads' own (NaN: async)
    latency_ms: dict[str, float]  # p50, p90, p99, max, count (latency runs)

    @property
    def committed_rate(self) -> float:
        return self.committed / self.seconds

    @property
    def drained_rate(self) -> float:
        return self.committed / self.drained_seconds

    def us_per_message(self, role: str) -> float:
        if role == "total":
            return sum(self.cpu.values()) / self.committed * 1e6
        return self.cpu.get(role, math.nan) / self.committed * 1e6


def worker_entry(name: str, db_url: str, config: dict[str, str], ready: Any) -> None:
    body = system(name).worker
    assert body is not None
    body(db_url, config, ready)


def run_one(measure: str, name: str, round_: int, settings: Settings, workdir: Path) -> Outcome:
    chosen = system(name)
    ctx = mp.get_context("spawn")
    with fresh_database(settings.admin_url) as db_url:
        chosen.install(db_url)
        with chosen.deploy(db_url, workdir) as deployment:
            worker = None
            if measure != "tax":
                assert chosen.worker is not None, f"{name} has no worker"
                ready = ctx.Event()
                worker = ctx.Process(
                    target=worker_entry,
                    args=(name, db_url, deployment.config, ready),
                    name=f"flow-worker-{name}",
                )
                worker.start()
                _wait(ready, worker, "worker")
            try:
                return _measure(
                    measure,
                    name,
                    round_,
                    settings,
                    db_url,
                    deployment.config,
                    {**deployment.roles, "worker": _pids_of(worker)},
                    ctx,
                    worker,
                )
            finally:
                if worker is not None:
                    worker.terminate()  # SIGTERM: each worker's graceful stop
                    worker.join(60)
                    if worker.is_alive():
                        worker.kill()


def _measure(
    measure: str,
    name: str,
    round_: int,
    settings: Settings,
    db_url: str,
    config: dict[str, str],
    roles: dict[str, Callable[[], list[psutil.Process]]],
    ctx: Any,
    worker: Any,
) -> Outcome:
    go, release, results = ctx.Event(), ctx.Event(), ctx.Queue()
    start = ctx.Value("d", 0.0)
    paced = measure == "latency"
    count = int(settings.rate * settings.seconds)
    per_process = max(1, settings.producers // settings.producer_processes)
    producers = []
    for n in range(settings.producer_processes):
        plan = Plan(
            first=n,
            stride=settings.producer_processes,
            connections=per_process,
            paced=paced,
            rate=settings.rate,
            count=count,
            seconds=settings.seconds,
        )
        ready = ctx.Event()
        proc = ctx.Process(
            target=producer_main,
            args=(name, db_url, config, plan, ready, go, start, release, results),
            name=f"flow-producer-{name}-{n}",
        )
        proc.start()
        _wait(ready, proc, "producer")
        producers.append(proc)
    db = Database(db_url)
    try:
        roles = {
            "producer": lambda: processes([p.pid for p in producers]),
            **roles,
            "postgres": lambda: processes(db.backend_pids()[0]),
            "pg shared": lambda: processes(db.backend_pids()[1]),
        }
        time.sleep(SETTLE)
        load = os.getloadavg()
        before = {role: cpu_snapshot(found()) for role, found in roles.items()}
        start.value = time.monotonic() + LEAD
        start_wall = time.time() + LEAD
        go.set()
        parts = [results.get(timeout=settings.seconds + 600) for _ in producers]
        produced = Produced(
            committed={k: v for part in parts for k, v in part.committed.items()},
            rolled_back=[order for part in parts for order in part.rolled_back],
            late=sum(part.late for part in parts),
            finished=max(part.finished for part in parts),
            caller_cpu=sum(part.caller_cpu for part in parts),
        )
        if measure == "tax":
            drained = _wait_sent(db, name, produced, settings.drain_timeout)
        else:
            drained = _wait_drained(db, produced, settings.drain_timeout, worker)
        after = {role: cpu_snapshot(found()) for role, found in roles.items()}
        release.set()
        for proc in producers:
            proc.join(120)
            if proc.exitcode != 0:
                raise RuntimeError(f"producer process exited with {proc.exitcode}")
        latency: dict[str, float] = {}
        if measure != "tax":
            time.sleep(SETTLE)  # a late duplicate would show now
            db.check_exactly_once(produced)
            latency = _latency(db.started(), produced, start_wall) if paced else {}
        return Outcome(
            measure=measure,
            system=name,
            round=round_,
            load=load,
            committed=len(produced.committed),
            rolled_back=len(produced.rolled_back),
            late=produced.late,
            seconds=produced.finished - start.value,
            drained_seconds=drained - start.value,
            cpu={role: cpu_spent(before[role], after[role]) for role in roles},
            caller_cpu=produced.caller_cpu,
            latency_ms=latency,
        )
    finally:
        release.set()
        for proc in producers:
            if proc.is_alive():
                proc.join(30)
            if proc.is_alive():
                proc.kill()
        db.close()


def _pids_of(process: Any) -> Callable[[], list[psutil.Process]]:
    return lambda: processes([process.pid]) if process is not None else []


def _wait(ready: Any, process: Any, what: str) -> None:
    deadline = time.monotonic() + 120
    while not ready.wait(0.2):
        if not process.is_alive():
            raise RuntimeError(f"{what} process exited with {process.exitcode} before it ran")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} process did not start in 120 s")


def _wait_drained(db: Database, produced: Produced, timeout: float, worker: Any) -> float:
    """Monotonic time at which the effects counted the committed transactions."""
    want = len(produced.committed)
    deadline = time.monotonic() + timeout
    while (have := db.count("flow_effects")) < want:
        if worker is not None and not worker.is_alive():
            raise RuntimeError(f"the worker exited with {worker.exitcode}; {have} of {want}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{have} effects of {want} committed after {timeout:.0f} s")
        time.sleep(POLL)
    return time.monotonic()


def _wait_sent(db: Database, name: str, produced: Produced, timeout: float) -> float:
    """The tax: the window closes when the outbox has sent every row (at once for the
    baseline, which sends nothing); each committed transaction left one row."""
    if name != "qmq":
        return produced.finished
    deadline = time.monotonic() + timeout
    query = "SELECT count(*) FILTER (WHERE status = 'sent'), count(*) FROM qmq_outbox"
    while True:
        row = db.conn.execute(query).fetchone()
        sent, rows = (int(row[0]), int(row[1])) if row else (0, 0)
        if rows != len(produced.committed):
            raise AssertionError(f"{rows} outbox rows for {len(produced.committed)} commits")
        if sent == rows:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sent} of {rows} outbox rows sent after {timeout:.0f} s")
        time.sleep(POLL)


def _latency(started: dict[int, float], produced: Produced, start_wall: float) -> dict[str, float]:
    """Commit -> handler start, ms, of the transactions committed after the warm-up."""
    delays = [
        started[order] - at for order, at in produced.committed.items() if at >= start_wall + WARMUP
    ]
    if len(delays) < 2:
        return {"count": float(len(delays))}
    cuts = statistics.quantiles(delays, n=100, method="inclusive")
    return {
        "p50": cuts[49] * 1000,
        "p90": cuts[89] * 1000,
        "p99": cuts[98] * 1000,
        "max": max(delays) * 1000,
        "count": float(len(delays)),
    }
