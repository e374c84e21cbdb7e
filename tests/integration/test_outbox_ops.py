"""``qmq outbox`` as a process on a fresh PostgreSQL database: status, dead, retry beside a
running compensator (each row out once, counted at a real broker), purge, bad input; and
the compensator's backlog gauges as scraped from its metrics port."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa

from qmq_outbox import migrate
from qmq_outbox.client import BrokerClient
from qmq_outbox.schema import outbox_table
from qmq_outbox.store import OutboxStore
from tests.support.broker_process import BrokerProcess, free_port
from tests.support.outbox import (
    pending_rows,
    stored_count,
    stored_ids,
    unique_subject,
    wait_for,
)
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def db_url(pg_admin_url: str) -> Iterator[str]:
    with fresh_database(pg_admin_url, prefix="qmq_ops") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(tmp_path_factory.mktemp("ops-broker") / "data").start()
    yield proc
    proc.stop()


def qmq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq_outbox", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def outbox(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command, *rest = args
    return qmq("outbox", command, "--database-url", db_url, *rest)


def rows(
    count: int,
    *,
    subject: str,
    status: str,
    app: str | None = "orders",
    age: timedelta = timedelta(minutes=5),
    **more: object,
) -> list[dict[str, object]]:
    made = pending_rows(count, subject=subject, age=age.total_seconds())
    for row in made:
        row.update(status=status, producer=app, **more)
        if status == "sent":
            row["sent_at"] = datetime.now(UTC) - age
    return made


def table(engine: sa.Engine, *columns: str) -> list[tuple[object, ...]]:
    t = outbox_table
    with engine.connect() as conn:
        stmt = sa.select(*(t.c[name] for name in columns)).order_by(t.c.id)
        return [tuple(row) for row in conn.execute(stmt)]


def test_status_and_dead_show_every_state(db_url: str, engine: sa.Engine) -> None:
    orders, refunds, loose = unique_subject("orders"), unique_subject("refunds"), unique_subject()
    store = OutboxStore(engine)
    store.insert(rows(3, subject=orders, status="pending", age=timedelta(minutes=10)))
    store.insert(rows(4, subject=orders, status="sent"))
    store.insert(rows(2, subject=orders, status="dead", attempts=16, last_error="rejected: x"))
    store.insert(rows(1, subject=refunds, status="sent", app="billing"))
    store.insert(rows(1, subject=loose, status="dead", app=None, attempts=3, last_error="a\nb"))

    shown = outbox(db_url, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    by_key = {(row["app"], row["subject"]): row for row in json.loads(shown.stdout)}
    assert set(by_key) == {("orders", orders), ("billing", refunds), (None, loose)}
    mine = by_key[("orders", orders)]
    assert (mine["pending"], mine["sent"], mine["dead"]) == (3, 4, 2)
    assert 600 <= mine["oldest_pending_age_s"] < 700
    assert by_key[("billing", refunds)] == {
        "app": "billing",
        "subject": refunds,
        "pending": 0,
        "oldest_pending_age_s": None,
        "sent": 1,
        "dead": 0,
    }
    assert by_key[(None, loose)]["dead"] == 1

    text = outbox(db_url, "status")
    assert text.returncode == 0, text.stderr
    line = next(line for line in text.stdout.splitlines() if orders in line)
    assert re.fullmatch(rf"orders\s+{re.escape(orders)}\s+3\s+10m0\ds\s+4\s+2", line), line
    assert text.stdout.splitlines()[0].split() == [
        "app",
        "subject",
        "pending",
        "oldest",
        "pending",
        "sent",
        "dead",
    ]

    dead = outbox(db_url, "dead", "--json")
    assert dead.returncode == 0, dead.stderr
    listed = json.loads(dead.stdout)
    assert [(r["subject"], r["attempts"], r["reason"]) for r in listed] == [
        (orders, 16, "rejected: x"),
        (orders, 16, "rejected: x"),
        (loose, 3, "a\nb"),
    ]
    created = datetime.fromisoformat(listed[0]["created_at"])
    assert abs(created - (datetime.now(UTC) - timedelta(minutes=5))) < timedelta(minutes=1)
    ids = [row[0] for row in table(engine, "id", "status") if row[1] == "dead"]
    assert [r["id"] for r in listed] == ids

    only = outbox(db_url, "dead", "--subject", loose)
    assert only.returncode == 0, only.stderr
    lines = only.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].split()[:3] == ["id", "message", "id"]
    assert lines[1].split()[-2:] == [listed[2]["created_at"], "a"]  # the reason's first line


def scrape(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None


def sample(text: str | None, name: str) -> float | None:
    """The value of the sample ``name`` (with its labels, if any) in ``text``."""
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_retry_while_a_compensator_runs_sends_each_row_once(
    db_url: str, engine: sa.Engine, broker: BrokerProcess
) -> None:
    subject, waiting = unique_subject("revive"), unique_subject("waiting")
    port = free_port()
    env = {**os.environ, "QMQ_COMPENSATOR_METRICS_PORT": str(port)}
    compensator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qmq_outbox",
            "compensator",
            "--database-url",
            db_url,
            "--broker-url",
            broker.url,
            "--interval",
            "100ms",
            "--grace",
            "0s",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        text = wait_for(lambda: scrape(port), timeout=30, what="the compensator's metrics")
        wait_for(
            lambda: sample(scrape(port), "qmq_compensator_dead_rows") == 0.0,
            timeout=30,
            what="a first pass",
        )
        # As a dispatcher leaves them: dead while the compensator runs, the last claim's
        # token and lease still on them; and a row waiting for a retry an hour away.
        later = datetime.now(UTC) + timedelta(hours=1)
        store = OutboxStore(engine)
        store.insert(
            rows(
                40,
                subject=subject,
                status="dead",
                attempts=16,
                last_error="rejected",
                claim_token="0" * 36,
                claimed_until=later,
            )
        )
        store.insert(rows(1, subject=waiting, status="pending", next_attempt_at=later, attempts=1))

        def counted() -> str | None:
            text = scrape(port)
            return text if sample(text, "qmq_compensator_dead_rows") == 40.0 else None

        text = wait_for(counted, timeout=30, what="the dead rows in the gauges")
        assert sample(text, "qmq_compensator_dead_messages_total") == 40.0
        assert sample(text, f'qmq_compensator_subject_dead_rows{{subject="{subject}"}}') == 40.0
        assert sample(text, "qmq_compensator_pending_messages") == 1.0
        age = sample(text, "qmq_compensator_oldest_pending_age_seconds")
        assert age is not None
        assert 300 <= age < 400
        labelled = f'qmq_compensator_subject_oldest_pending_age_seconds{{subject="{waiting}"}}'
        assert sample(text, labelled) == age

        # Two operators at once, while passes run: every dead row revived once.
        first = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qmq_outbox",
                "outbox",
                "retry",
                "--database-url",
                db_url,
                "--subject",
                subject,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        second = outbox(db_url, "retry", "--all")
        out, _ = first.communicate(timeout=60)
        assert first.returncode == 0
        assert second.returncode == 0, second.stderr
        revived = [re.findall(r"retried (\d+) dead row", text) for text in (out, second.stdout)]
        assert sum(int(count) for (count,) in revived) == 40

        def revived_rows() -> list[tuple[object, ...]]:
            found = table(engine, "message_id", "subject", "attempts", "status")
            return [row for row in found if row[1] == subject]

        wait_for(
            lambda: {row[3] for row in revived_rows()} == {"sent"},
            timeout=60,
            what="the revived rows sent",
        )
        assert {row[2] for row in revived_rows()} == {1}, "a revived row was claimed twice"
        with BrokerClient(broker.url) as client:
            stored = stored_ids(client, subject)
            assert stored_count(client, subject) == 40
        assert stored == {row[0]: 1 for row in revived_rows()}
        settled = wait_for(
            lambda: (t := scrape(port)) and sample(t, "qmq_compensator_dead_rows") == 0.0 and t,
            timeout=30,
            what="the gauges after the retry",
        )
        assert sample(settled, "qmq_compensator_dead_messages_total") == 40.0
    finally:
        compensator.terminate()
        compensator.wait(30)


def test_purge_removes_only_sent_rows_older_than_the_cutoff(db_url: str, engine: sa.Engine) -> None:
    subject = unique_subject("purge")
    old = timedelta(days=10)
    OutboxStore(engine).insert(
        rows(5, subject=subject, status="sent", age=old)
        + rows(3, subject=subject, status="sent", age=timedelta(days=1))
        + rows(2, subject=subject, status="pending", age=old)
        + rows(2, subject=subject, status="dead", age=old, last_error="x")
    )
    before = table(engine, "id", "status", "sent_at")
    done = outbox(db_url, "purge", "--older-than", "7d", "--batch-size", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("purged 5 sent row(s) sent before ")
    kept = [
        row
        for row in before
        if not (row[1] == "sent" and row[2] < datetime.now(UTC) - timedelta(days=7))
    ]
    assert table(engine, "id", "status", "sent_at") == kept
    assert [row[1] for row in kept] == ["sent"] * 3 + ["pending"] * 2 + ["dead"] * 2
    again = outbox(db_url, "purge", "--older-than", "7d")
    assert again.stdout.startswith("purged 0 sent row(s)")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["retry"], "give one of --id, --subject or --all"),
        (["retry", "--all", "--subject", "a"], "not --subject and --all together"),
        (["retry", "--id", "seven"], "'--id'"),
        (["retry", "--subject", "no spaces"], "is not a subject name"),
        (["purge"], "--older-than"),
        (["purge", "--older-than", "3 parsecs"], "is not a duration"),
        (["dead", "--limit", "0"], "'--limit'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(db_url: str, args: list[str], says: str) -> None:
    done = outbox(db_url, *args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"qmq outbox {args[0]}: error: ")
    assert says in done.stderr


def test_unusable_databases_are_one_line_and_exit_2_or_3(pg_admin_url: str) -> None:
    wrong = qmq("outbox", "status", "--database-url", "mysql://u@127.0.0.1/x")
    assert wrong.returncode == 2
    assert "mysql is not supported" in wrong.stderr
    with fresh_database(pg_admin_url, prefix="qmq_ops_empty") as url:
        empty = qmq("outbox", "dead", "--database-url", url)
    assert empty.returncode == 3
    assert empty.stderr.count("\n") == 1
    assert "has no qmq_outbox table" in empty.stderr
    closed = qmq(
        "outbox", "status", "--database-url", f"postgresql+psycopg://u@127.0.0.1:{free_port()}/x"
    )
    assert closed.returncode == 3
    assert "cannot connect to" in closed.stderr
