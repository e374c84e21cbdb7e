"""The whole flow a team compares (issue 37): a service transaction enqueues a message, a
worker's handler writes its effect; the qmq outbox beside pgqueuer, procrastinate and a
hand-written PostgreSQL table queue.

    .venv/bin/python bench/flow.py [--systems qmq,pgqueuer,procrastinate,tablequeue]
        [--rounds 3] [--seconds 10] [--producers 8] [--rate 200]
        [--only throughput|latency|tax] [--json flow.json]

Every system runs as its own processes, the way a user deploys it: producer processes (the
service: `with Session.begin()`: a business row and one message; one transaction in 20
rolls back after both), a worker process whose handler writes an effect row, and for qmq a
`qmq broker` and a `qmq compensator`; bench/_flow/<system>.py says how each is configured.
Each run gets a fresh database (dropped after). After each run the effects table must hold
exactly one row per committed transaction and none for a rolled-back one, or the run fails
loudly (exit status 1).

Measures: throughput (committed and drained msg/s with --producers flat out, CPU per message
of every process: producers, worker, broker, compensator, this database's PostgreSQL
backends, the server's WAL writer / checkpointer / background writer); latency (commit ->
handler start at --rate msg/s offered, p50 / p90 / p99); tax (the producer process's CPU
per message with and without `Outbox.publish` in the same transaction, and with one raw
outbox-shaped INSERT instead: the floor of any transactional outbox). Rounds interleave
the systems in a rotated order; the tables give medians, per-round ratios against pgqueuer
and the load average at each run's start.

Smoke run: --rounds 1 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._cli import positive, positive_float
from bench._flow.common import ADMIN_URL, ExactlyOnceError
from bench._flow.report import Report
from bench._flow.run import MEASURES, Outcome, Settings, run_one
from bench._flow.systems import system
from bench._peers.common import rotated, version_of
from bench._speed import python_speed

SYSTEMS = ("qmq", "pgqueuer", "procrastinate", "tablequeue")
TAXED = ("plain", "onerow", "qmq")  # the tax: no message, its floor, ours


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds of every measure")
    parser.add_argument("--seconds", type=positive_float, default=10, help="length of each run")
    parser.add_argument(
        "--producers", type=positive, default=8, help="transactions in flight at once"
    )
    parser.add_argument(
        "--producer-processes",
        type=positive,
        default=2,
        help="processes of the service the producers are spread over",
    )
    parser.add_argument(
        "--rate", type=positive_float, default=200, help="latency: transactions/s offered"
    )
    parser.add_argument(
        "--only",
        choices=MEASURES,
        action="append",
        help="run this measure only (repeat for several); default all",
    )
    parser.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=180,
        help="s to wait for the effects after the last commit before the run fails",
    )
    parser.add_argument("--admin-url", default=ADMIN_URL, help="runs CREATE/DROP DATABASE")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))}")
    return args


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def progress(outcome: Outcome) -> str:
    if outcome.latency_ms:
        got = outcome.latency_ms
        figure = (
            f"p50 {got.get('p50', math.nan):.1f} p90 {got.get('p90', math.nan):.1f}"
            f" p99 {got.get('p99', math.nan):.1f} ms"
        )
    elif outcome.measure == "tax":
        figure = f"committed {outcome.committed_rate:,.0f}/s"
    else:
        figure = f"committed {outcome.committed_rate:,.0f}/s drained {outcome.drained_rate:,.0f}/s"
    if outcome.measure != "tax":
        check = ", exactly once"
    else:
        check = ", every outbox row sent" if outcome.system == "qmq" else ""
    cpu = ", ".join(f"{role} {outcome.us_per_message(role):.0f}" for role in outcome.cpu)
    return (
        f"round {outcome.round} {outcome.measure:<10} {outcome.system:<13} {figure};"
        f" {outcome.committed:,} committed, {outcome.rolled_back:,} rolled back{check};"
        f" CPU µs/msg: {cpu}; load {outcome.load[0]:.2f}"
    )


def run_rounds(
    args: argparse.Namespace, chosen: list[str], settings: Settings, tmp: Path
) -> tuple[list[Outcome], list[str], list[str]]:
    """Every measure on every system per round; (outcomes, `uptime` per round, failures)."""
    measures = [m for m in MEASURES if not args.only or m in args.only]
    outcomes: list[Outcome] = []
    rounds_load: list[str] = []
    failures: list[str] = []
    for round_ in range(1, args.rounds + 1):
        rounds_load.append(f"round {round_}: {uptime()}")
        print(rounds_load[-1], file=sys.stderr, flush=True)
        for measure in measures:
            if measure == "tax" and "qmq" not in chosen:
                continue
            names = list(TAXED) if measure == "tax" else chosen
            for name in rotated(names, round_ - 1):
                workdir = tmp / f"{round_}-{measure}-{name}"
                workdir.mkdir()
                try:
                    outcome = run_one(measure, name, round_, settings, workdir)
                except ExactlyOnceError as exc:
                    failures.append(f"round {round_} {measure} {name}: NOT EXACTLY ONCE: {exc}")
                except Exception as exc:
                    failures.append(f"round {round_} {measure} {name}: FAILED: {exc!r}")
                else:
                    outcomes.append(outcome)
                    print(progress(outcome), file=sys.stderr, flush=True)
                    continue
                print(failures[-1], file=sys.stderr, flush=True)
    return outcomes, rounds_load, failures


def main() -> None:
    args = parse_args()
    chosen = [name for name in SYSTEMS if name in args.systems.split(",")]
    settings = Settings(
        admin_url=args.admin_url,
        seconds=args.seconds,
        producers=args.producers,
        producer_processes=min(args.producer_processes, args.producers),
        rate=args.rate,
        drain_timeout=args.drain_timeout,
    )
    began = time.gmtime()
    scratch = os.environ.get("QMQ_BENCH_DIR")
    with tempfile.TemporaryDirectory(prefix="qmq-flow-", dir=scratch) as tmp:
        outcomes, rounds_load, failures = run_rounds(args, chosen, settings, Path(tmp))
    report = Report(outcomes, chosen, settings)
    command = "python bench/flow.py " + shlex.join(sys.argv[1:])
    print(
        f"`{command.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', began)},"
        f" {platform.node()}: {os.cpu_count()} vCPU, Python {platform.python_version()};"
        f" {python_speed()}. {args.rounds} round(s), the systems' order rotated by one each"
        " round; every run on a fresh database, its effects checked exactly once.\n"
    )
    print("\n".join(f"- {line}" for line in rounds_load) + "\n")
    print(report.markdown())
    taxed = [n for n in TAXED if n != "qmq"] if any(o.measure == "tax" for o in outcomes) else []
    for name in [*chosen, *taxed]:
        print(f"- {system(name).note}; {versions(name)}")
    if failures:
        print("\nFAILED:\n" + "\n".join(f"- {f}" for f in failures))
    if args.json:
        document: dict[str, Any] = report.as_json() | {
            "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", began),
            "rounds_load": rounds_load,
            "failures": failures,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if failures:
        sys.exit(1)


def versions(name: str) -> str:
    library = {"pgqueuer": "pgqueuer", "procrastinate": "procrastinate"}.get(name)
    driver = "asyncpg" if name == "pgqueuer" else "psycopg"
    found = f"{driver} {version_of(driver)}"
    return f"{library} {version_of(library)}, {found}" if library else found


if __name__ == "__main__":
    main()
