"""``make demo``: the whole promise on embedded defaults, with failures on purpose.

Starts a broker on a data dir under ``.demo/``, an orders service on a SQLite file that
publishes through the outbox, a compensator, two billing consumers with an idempotent store
and two broadcast notification consumers; each order's status changes also go to an
ordered subject, ``order.state`` (2 partitions), whose consumer checks that it sees every
order's ``placed`` before its ``paid`` or ``cancelled``. While orders flow it kill -9s the
broker and restarts it (the compensator catches up), splits a partition of ``order.state``,
and kill -9s a billing consumer mid-batch (its leases expire and the idempotent store
suppresses the redeliveries). Then it runs the Spark reconciliation (its ``out_of_order``
check included) and prints a verdict. Re-runnable: ``.demo/`` is recreated each time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.progress import Progress as RichProgress
from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import func, select, text

from examples.billing import prepare_database as prepare_billing
from examples.orders.models import Order
from examples.orders.service import STATE_SUBJECT, connect, make_service, prepare_database
from qmq_outbox import Consumer, Message, Outbox
from qmq_outbox.client import BrokerClient

console = Console()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Proc:
    """A child process with its log file, killable with SIGKILL and restartable."""

    def __init__(self, name: str, args: list[str], logs: Path) -> None:
        self.name = name
        self.args = args
        self.log = logs / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.args], stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None


@dataclass
class Progress:
    placed: int = 0
    paid: int = 0
    cancelled: int = 0
    events: list[str] = field(default_factory=list)
    states: dict[int, list[str]] = field(default_factory=dict)  # order -> states seen
    states_lock: threading.Lock = field(default_factory=threading.Lock)

    def state(self, order_id: int, state: str) -> None:
        with self.states_lock:
            seen = self.states.setdefault(order_id, [])
            if not seen or seen[-1] != state:  # a redelivery repeats the last one
                seen.append(state)

    def out_of_order(self) -> int:
        """Orders whose states did not come as placed, then at most one of paid/cancelled."""
        with self.states_lock:
            return sum(
                1
                for seen in self.states.values()
                if seen[0] != "placed" or len(seen) > 2 or "placed" in seen[1:]
            )

    def in_order(self) -> int:
        """Orders whose every state change came, in order: placed, then paid or cancelled."""
        with self.states_lock:
            return sum(
                1
                for seen in self.states.values()
                if seen in (["placed", "paid"], ["placed", "cancelled"])
            )

    def event(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")


def wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"broker at {url} did not become healthy; see .demo/logs/broker.log")


def count(engine: Any, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def notifications(path: Path) -> int:
    """Distinct orders notified: delivery is at least once, so a line may repeat."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return len({line.split()[1] for line in lines if line.startswith("order.created ")})


def duplicates_suppressed(stats_files: list[Path]) -> int:
    total = 0
    for path in stats_files:
        for item in sorted(path.parent.glob(path.name + "*")):
            try:
                total += int(json.loads(item.read_text())["duplicates"])
            except (OSError, ValueError, KeyError):
                pass
    return total


def dashboard(progress: Progress, numbers: dict[str, int], total: int) -> Table:
    table = Table(
        title=f"qmq-outbox demo: {progress.placed}/{total} orders placed", show_header=False
    )
    table.add_column("what", style="cyan")
    table.add_column("count", justify="right")
    for name, value in numbers.items():
        table.add_row(name, str(value))
    for line in progress.events[-4:]:
        table.add_row("[yellow]event[/yellow]", line)
    return table


def reconciliation_words(exit_code: int | None, skipped: bool) -> str:
    if skipped:
        return "skipped (--skip-reconcile)"
    if exit_code is None:
        return "not run"
    words = {0: "clean (exit 0)", 1: "CRITICAL findings (exit 1)"}
    return words.get(exit_code, f"failed (exit {exit_code})")


def run_reconcile(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``qmq reconcile`` and show its stages as they end (its stderr is a pipe here, so
    it writes one plain line per stage), with a spinner and the time so far meanwhile."""
    with (
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as proc,
        RichProgress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as shown,
    ):
        out, err = proc.stdout, proc.stderr
        assert out is not None
        assert err is not None
        stdout: list[str] = []
        reader = threading.Thread(target=lambda: stdout.append(out.read()), name="demo-stdout")
        reader.start()
        shown.add_task("Spark reconciles the outbox with the broker logs", total=None)
        stderr = []
        for line in err:
            stderr.append(line)
            shown.console.print(f"  {line.rstrip()}", markup=False, highlight=False)
        reader.join()
        code = proc.wait()
    return subprocess.CompletedProcess(command, code, "".join(stdout), "".join(stderr))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--orders", type=int, default=300)
    parser.add_argument("--rate", type=float, default=25.0, help="orders per second")
    parser.add_argument("--dir", type=Path, default=Path(".demo"))
    parser.add_argument(
        "--cancel-after",
        type=float,
        default=4.0,
        help="seconds before an unpaid order is cancelled",
    )
    parser.add_argument("--short", action="store_true", help="a quick run for CI")
    parser.add_argument("--skip-reconcile", action="store_true")
    args = parser.parse_args(argv)
    if args.short:
        args.orders, args.rate = 120, 20.0

    root: Path = args.dir.resolve()
    shutil.rmtree(root, ignore_errors=True)
    logs = root / "logs"
    logs.mkdir(parents=True)
    logging.basicConfig(
        filename=logs / "demo.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    orders_url = f"sqlite:///{root / 'orders.db'}"
    billing_url = f"sqlite:///{root / 'billing.db'}"
    broker_data = root / "broker-data"
    port = free_port()
    broker_url = f"http://127.0.0.1:{port}"
    py = ["-m", "qmq_outbox"]

    console.print(f"[bold]qmq-outbox demo[/bold]: everything under {root}")
    broker = Proc(
        "broker",
        [
            *py,
            "broker",
            "--data-dir",
            str(broker_data),
            "--port",
            str(port),
            "--ack-timeout",
            "3s",
            "--checkpoint-interval",
            "1s",
        ],
        logs,
    ).start()
    wait_healthy(broker_url)
    with BrokerClient(broker_url) as client:
        client.declare_subject(STATE_SUBJECT, partitions=2)
    engine, sessions = connect(orders_url)
    prepare_database(engine)
    billing_engine, _ = connect(billing_url)
    prepare_billing(billing_engine)
    stats = [root / "billing-b1.json", root / "billing-b2.json"]
    consumers = {
        "billing-b1": Proc(
            "billing-b1",
            [
                "-m",
                "examples.billing",
                "--broker-url",
                broker_url,
                "--database-url",
                billing_url,
                "--consumer-id",
                "b1",
                "--stats-file",
                str(stats[0]),
            ],
            logs,
        ),
        "billing-b2": Proc(
            "billing-b2",
            [
                "-m",
                "examples.billing",
                "--broker-url",
                broker_url,
                "--database-url",
                billing_url,
                "--consumer-id",
                "b2",
                "--stats-file",
                str(stats[1]),
            ],
            logs,
        ),
        "notify-email": Proc(
            "notify-email",
            [
                "-m",
                "examples.notifications",
                "--broker-url",
                broker_url,
                "--consumer-id",
                "email",
                "--out",
                str(root / "email.txt"),
            ],
            logs,
        ),
        "notify-sms": Proc(
            "notify-sms",
            [
                "-m",
                "examples.notifications",
                "--broker-url",
                broker_url,
                "--consumer-id",
                "sms",
                "--out",
                str(root / "sms.txt"),
            ],
            logs,
        ),
    }
    compensator = Proc(
        "compensator",
        [
            *py,
            "compensator",
            "--database-url",
            orders_url,
            "--broker-url",
            broker_url,
            "--interval",
            "500ms",
            "--grace",
            "2s",
        ],
        logs,
    ).start()
    for proc in consumers.values():
        proc.start()

    progress = Progress()
    outbox = Outbox(broker_url=broker_url, app="orders")
    service = make_service(sessions, outbox, cancel_after=timedelta(seconds=args.cancel_after))
    timeouts = Consumer(broker_url, "orders-timeouts", wait_ms=500)

    @timeouts.handler("order.payment_due")
    def on_payment_due(message: Message) -> None:
        if service.cancel_if_unpaid(message.json()["order_id"]):
            progress.cancelled += 1

    timeout_thread = threading.Thread(
        target=timeouts.run, kwargs={"install_signal_handlers": False}, name="demo-timeouts"
    )
    timeout_thread.start()
    history = Consumer(broker_url, "order-history", wait_ms=500)

    @history.handler(STATE_SUBJECT, ordered=True)
    def on_state(message: Message) -> None:
        body = message.json()
        progress.state(body["order_id"], body["state"])

    history_thread = threading.Thread(
        target=history.run, kwargs={"install_signal_handlers": False}, name="demo-history"
    )
    history_thread.start()

    def place_orders() -> None:
        rng = random.Random(42)
        for n in range(args.orders):
            order_id = service.place_order(f"customer-{n % 13}", rng.randint(500, 90_000))
            progress.placed += 1
            if rng.random() < 0.7 and service.pay_order(order_id):
                progress.paid += 1
            time.sleep(1 / args.rate)

    def chaos() -> None:
        while progress.placed < args.orders * 0.3:
            time.sleep(0.05)
        broker.kill9()
        progress.event("broker killed with SIGKILL; orders keep committing, rows stay pending")
        time.sleep(2)
        broker.start()
        wait_healthy(broker_url)
        progress.event("broker restarted; recovery done, compensator resends pending rows")
        while progress.placed < args.orders * 0.45:
            time.sleep(0.05)
        with BrokerClient(broker_url) as client:
            routes = client.split_partition(STATE_SUBJECT, partition=0, at=256)
        ranges = ", ".join(f"[{r['lo']},{r['hi']})->p{r['partition']}" for r in routes["ranges"])
        progress.event(f"order.state partition 0 split: route v{routes['version']} {ranges}")
        while progress.placed < args.orders * 0.6:
            time.sleep(0.05)
        consumers["billing-b1"].kill9()
        progress.event("billing consumer b1 killed mid-batch; its leases expire in 3s")
        time.sleep(1)
        os.replace(stats[0], stats[0].with_name(stats[0].name + ".before-kill")) if stats[
            0
        ].exists() else None
        consumers["billing-b1"].start()
        progress.event("billing consumer b1 restarted")

    producer = threading.Thread(target=place_orders, name="demo-orders")
    chaos_thread = threading.Thread(target=chaos, name="demo-chaos")
    producer.start()
    chaos_thread.start()

    def numbers() -> dict[str, int]:
        return {
            "outbox rows committed": count(engine, "SELECT count(*) FROM qmq_outbox"),
            "outbox rows pending": count(
                engine, "SELECT count(*) FROM qmq_outbox WHERE status = 'pending'"
            ),
            "invoices (billing, exactly once)": count(
                billing_engine, "SELECT count(*) FROM invoices"
            ),
            "orders notified by email": notifications(root / "email.txt"),
            "orders notified by sms": notifications(root / "sms.txt"),
            "orders paid": progress.paid,
            "unpaid orders cancelled by delayed message": progress.cancelled,
            "duplicates suppressed by IdempotentStore": duplicates_suppressed(stats),
            "orders whose state changes came in order": progress.in_order(),
            "orders whose state changes came out of order": progress.out_of_order(),
        }

    deadline = None
    with Live(
        dashboard(progress, numbers(), args.orders),
        console=console,
        refresh_per_second=4,
        transient=False,
    ) as live:
        while True:
            current = numbers()
            live.update(dashboard(progress, current, args.orders))
            done = (
                not producer.is_alive()
                and not chaos_thread.is_alive()
                and current["outbox rows pending"] == 0
                and current["invoices (billing, exactly once)"] == progress.placed
                and current["orders notified by email"] >= progress.placed
                and current["orders notified by sms"] >= progress.placed
                and progress.paid + progress.cancelled == progress.placed
                and current["orders whose state changes came in order"] == progress.placed
            )
            if done:
                break
            if not producer.is_alive() and deadline is None:
                deadline = time.monotonic() + 120
            if deadline is not None and time.monotonic() > deadline:
                progress.event("timed out waiting for the system to settle")
                break
            time.sleep(0.25)

    timeouts.stop()
    timeout_thread.join(30)
    history.stop()
    history_thread.join(30)
    outbox.close()
    for proc in consumers.values():
        proc.stop()
    compensator.stop()
    final = numbers()
    broker_stats = httpx.get(f"{broker_url}/v1/subjects", timeout=10).json()["subjects"]
    stored = sum(s["messages"] for s in broker_stats)
    broker.stop()
    with engine.connect() as conn:
        statuses = dict(
            conn.execute(select(Order.status, func.count()).group_by(Order.status)).all()
        )
    engine.dispose()
    billing_engine.dispose()

    reconcile: dict[str, Any] = {"exit_code": None}
    report_dir = root / "report"
    if not args.skip_reconcile:
        console.print(
            "\n[bold]Reconciliation[/bold] (Spark, local mode): outbox table vs broker logs"
        )
        run = run_reconcile(
            [
                sys.executable,
                *py,
                "reconcile",
                "--outbox",
                orders_url,
                "--broker-data",
                str(broker_data),
                "--out",
                str(report_dir),
                "--grace",
                "0s",
                "--master",
                "local[2]",
            ]
        )
        (logs / "reconcile.log").write_text(run.stdout + run.stderr)
        console.print(run.stdout.strip())
        summary_path = report_dir / "summary.json"
        reconcile = (
            json.loads(summary_path.read_text())
            if summary_path.exists()
            else {"exit_code": run.returncode}
        )
        reconcile["process_exit_code"] = run.returncode

    verdict = {
        "orders_placed": progress.placed,
        "orders_paid": statuses.get("paid", 0),
        "orders_cancelled": statuses.get("cancelled", 0),
        "messages_committed": final["outbox rows committed"],
        "messages_stored": stored,
        "outbox_pending": final["outbox rows pending"],
        "invoices": final["invoices (billing, exactly once)"],
        "notifications_email": final["orders notified by email"],
        "notifications_sms": final["orders notified by sms"],
        "duplicates_suppressed": final["duplicates suppressed by IdempotentStore"],
        "orders_states_in_order": final["orders whose state changes came in order"],
        "orders_states_out_of_order": final["orders whose state changes came out of order"],
        "reconciliation_exit_code": reconcile.get("process_exit_code"),
        "reconciliation_out_of_order": (reconcile.get("out_of_order") or {}).get("count"),
        "reconciliation_acked_out_of_order": (
            (reconcile.get("out_of_order") or {}).get("acked") or {}
        ).get("count"),
        "reconciliation_categories": reconcile.get("categories", {}),
        "events": progress.events,
    }
    ok = (
        verdict["outbox_pending"] == 0
        and verdict["messages_stored"] == verdict["messages_committed"]
        and verdict["invoices"] == verdict["orders_placed"]
        and verdict["notifications_email"] == verdict["orders_placed"]
        and verdict["notifications_sms"] == verdict["orders_placed"]
        and verdict["orders_paid"] + verdict["orders_cancelled"] == verdict["orders_placed"]
        and verdict["orders_states_in_order"] == verdict["orders_placed"]
        and verdict["orders_states_out_of_order"] == 0
        and (args.skip_reconcile or verdict["reconciliation_exit_code"] == 0)
        and (args.skip_reconcile or verdict["reconciliation_out_of_order"] == 0)
        and (args.skip_reconcile or verdict["reconciliation_acked_out_of_order"] == 0)
    )
    verdict["ok"] = ok
    (root / "verdict.json").write_text(json.dumps(verdict, indent=2))

    console.print("\n[bold]Verdict[/bold]")
    for line in progress.events:
        console.print(f"  {line}")
    v = verdict
    reconciled = reconciliation_words(v["reconciliation_exit_code"], args.skip_reconcile)
    console.print(
        f"  orders placed {v['orders_placed']} (paid {v['orders_paid']}, "
        f"cancelled unpaid {v['orders_cancelled']} by a delayed message)\n"
        f"  messages committed {v['messages_committed']}, "
        f"stored in the broker {v['messages_stored']}, still pending {v['outbox_pending']}\n"
        f"  invoices {v['invoices']} (one per order), email {v['notifications_email']} "
        f"and sms {v['notifications_sms']} notifications (broadcast)\n"
        f"  duplicates suppressed by the idempotent store: {v['duplicates_suppressed']}\n"
        f"  order.state (ordered, split while running): {v['orders_states_in_order']} orders "
        f"seen placed -> paid/cancelled in order, {v['orders_states_out_of_order']} out of "
        f"order; reconciliation out_of_order: stored {v['reconciliation_out_of_order']}, "
        f"acked {v['reconciliation_acked_out_of_order']}\n"
        f"  reconciliation: {reconciled}"
    )
    console.print(
        f"  report: {report_dir / 'report.html'}  summary: {report_dir / 'summary.json'}\n"
        f"  logs: {logs}  verdict: {root / 'verdict.json'}"
    )
    console.print(
        "[bold green]ALL GOOD[/bold green]"
        if ok
        else "[bold red]SOMETHING IS OFF[/bold red] (see the logs)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
