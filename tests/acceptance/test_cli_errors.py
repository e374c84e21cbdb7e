"""Each ``qmq`` command fails in one line on stderr, naming what and where, with its exit code:
2 bad input, 3 a database, broker or directory that cannot be used, 1 failed work.

Every case runs ``python -m qmq_outbox`` as a process against real PostgreSQL and real broker
processes. The cases of the table need nothing but their arguments, so they run side by side.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from qmq_outbox import migrate
from qmq_outbox.store import OutboxStore
from tests.support.broker_process import BrokerProcess, free_port
from tests.support.outbox import pending_rows, statuses, unique_subject
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(120)

PASSWORD = "s3cret-pw"
REFUSED_DB = f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:5999/x"

# name: (arguments, exit code, what the one line holds); {placeholders} are filled in below
CASES: dict[str, tuple[list[str], int, list[str]]] = {
    "db: not a URL": (
        ["db", "upgrade", "--database-url", "notaurl"],
        2,
        ["qmq db upgrade: error: ", "'--database-url'", "'notaurl' is not a SQLAlchemy URL"],
    ),
    "db: refused port": (
        ["db", "upgrade", "--database-url", REFUSED_DB],
        3,
        [
            "qmq db upgrade: error: cannot connect to "
            "postgresql+psycopg://postgres:***@127.0.0.1:5999/x: connection refused"
        ],
    ),
    "db: missing database": (
        ["db", "upgrade", "--database-url", "{missing_db}"],
        3,
        [
            "qmq db upgrade: error: cannot connect to ",
            'database "qmq_cli_none" does not exist',
        ],
    ),
    "db: unsupported dialect": (
        ["db", "upgrade", "--database-url", "mysql://x@localhost/db"],
        2,
        ["qmq db upgrade: error: ", "mysql is not supported: use a postgresql or sqlite URL"],
    ),
    "db: unknown revision": (
        ["db", "downgrade", "--database-url", "{db}", "--revision", "nosuch"],
        2,
        ["qmq db downgrade: error: Can't locate revision identified by 'nosuch'"],
    ),
    "compensator: refused database": (
        ["compensator", "--database-url", REFUSED_DB, "--broker-url", "{no_broker}", "--once"],
        3,
        ["qmq compensator: error: cannot connect to ", "127.0.0.1:5999/x: connection refused"],
    ),
    "compensator: no outbox table": (
        ["compensator", "--database-url", "{empty_db}", "--broker-url", "{no_broker}", "--once"],
        3,
        ["qmq compensator: error: ", "has no qmq_outbox table", "qmq db upgrade"],
    ),
    "compensator: unreachable broker": (
        ["compensator", "--database-url", "{db}", "--broker-url", "{no_broker}", "--once"],
        3,
        ["qmq compensator: error: cannot reach broker at {no_broker}: connection refused"],
    ),
    "compensator: bad broker URL": (
        ["compensator", "--database-url", "{db}", "--broker-url", "not-a-url", "--once"],
        2,
        ["qmq compensator: error: ", "'--broker-url'", "use http(s)://host[:port]"],
    ),
    "broker: data dir it cannot create": (
        ["broker", "--data-dir", "{tmp}/a-file/data", "--port", "{free_port}"],
        3,
        ["qmq broker: error: cannot create data directory {tmp}/a-file/data: not a directory"],
    ),
    "broker: unknown data format": (
        ["broker", "--data-dir", "{tmp}/future", "--port", "{free_port}"],
        3,
        ["qmq broker: error: {tmp}/future holds data format 99; this broker reads 1 to "],
    ),
    "broker: address in use": (
        ["broker", "--data-dir", "{tmp}/busy", "--port", "{busy_port}"],
        3,
        ["qmq broker: error: cannot listen on 127.0.0.1:{busy_port}: address already in use"],
    ),
    "reconcile: missing broker data": (
        ["reconcile", "--outbox", "{empty_db}", "--broker-data", "{tmp}/none", "--out", "{tmp}/o"],
        2,
        ["qmq reconcile: error: broker data directory {tmp}/none does not exist"],
    ),
    "reconcile: bad database URL": (
        [
            "reconcile",
            "--outbox",
            "postgresql://u:{password}@h:port/x",
            "--broker-data",
            "{tmp}",
            "--out",
            "{tmp}/o",
        ],
        2,
        ["qmq reconcile: error: outbox URL ", "is not a database URL"],
    ),
}


def qmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq_outbox", *args], capture_output=True, text=True, timeout=90
    )


@pytest.fixture(scope="module")
def migrated_db(pg_admin_url: str) -> Iterator[str]:
    """A PostgreSQL database of this module with the SDK's tables."""
    with fresh_database(pg_admin_url, prefix="qmq_cli") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(scope="module")
def places(
    tmp_path_factory: pytest.TempPathFactory, pg_admin_url: str, migrated_db: str
) -> Iterator[dict[str, str]]:
    """The values of the table's placeholders; a port held busy while the cases run."""
    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "a-file").write_text("not a directory")
    (tmp / "future").mkdir()
    (tmp / "future" / "FORMAT").write_text('{"format": 99}')
    sa.create_engine(f"sqlite:///{tmp / 'empty.db'}").connect().close()
    missing_db = make_url(pg_admin_url).set(database="qmq_cli_none")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        yield {
            "tmp": str(tmp),
            "missing_db": missing_db.render_as_string(hide_password=False),
            "db": migrated_db,
            "empty_db": f"sqlite:///{tmp / 'empty.db'}",
            "no_broker": f"http://127.0.0.1:{free_port()}",
            "free_port": str(free_port()),
            "busy_port": str(busy.getsockname()[1]),
            "password": PASSWORD,
        }


@pytest.fixture(scope="module")
def outcomes(places: dict[str, str]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case of the table, run side by side (each is mostly interpreter start-up)."""

    def run(name: str) -> subprocess.CompletedProcess[str]:
        args = [arg.format(**places) for arg in CASES[name][0]]
        return qmq(*args)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(CASES, pool.map(run, CASES), strict=True))


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize("name", list(CASES))
def test_a_failure_is_one_line_naming_what_and_where_with_its_exit_code(
    name: str, outcomes: dict[str, subprocess.CompletedProcess[str]], places: dict[str, str]
) -> None:
    _, code, needles = CASES[name]
    done = outcomes[name]
    line = one_line(done)
    assert done.returncode == code, done.stderr
    for needle in needles:
        assert needle.format(**places) in line
    assert PASSWORD not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_debug_adds_the_traceback_before_the_line() -> None:
    done = qmq("--debug", "db", "upgrade", "--database-url", REFUSED_DB)
    assert done.returncode == 3
    assert done.stderr.startswith("Traceback (most recent call last)")
    assert "sqlalchemy.exc.OperationalError" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("qmq db upgrade: error: cannot connect to ")
    assert PASSWORD not in last


def test_permission_denied_names_the_database(pg_admin_url: str, migrated_db: str) -> None:
    role = f"qmq_cli_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with fresh_database(pg_admin_url, prefix="qmq_cli_denied") as url:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        try:
            as_role = make_url(url).set(username=role, password=None)
            done = qmq("db", "upgrade", "--database-url", as_role.render_as_string(False))
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP ROLE {role}"))
            admin.dispose()
    assert done.returncode == 3, done.stderr
    line = one_line(done)
    assert line.startswith(f"qmq db upgrade: error: postgresql+psycopg://{role}@")
    assert "permission denied for schema public" in line


def test_compensator_once_exits_1_when_the_broker_rejects_rows(
    tmp_path: Path, migrated_db: str
) -> None:
    broker = BrokerProcess(tmp_path / "data", extra_args=["--max-body-size", "1024"]).start()
    engine = sa.create_engine(migrated_db)
    subject = unique_subject("cli-rejected")
    try:
        rows = pending_rows(2, subject=subject) + pending_rows(1, subject=subject, body=b"x" * 2048)
        OutboxStore(engine).insert(rows)
        done = qmq(
            "compensator", "--database-url", migrated_db, "--broker-url", broker.url, "--once",
            "--grace", "0s",
        )  # fmt: skip
        assert sorted(statuses(engine, subject=subject).values()) == ["dead", "sent", "sent"]
    finally:
        broker.stop()
        engine.dispose()
    assert done.returncode == 1, done.stderr
    assert "claimed=3 sent=2 duplicates=0 retried=0 dead=1" in done.stdout
    line = one_line(done)
    assert line == (
        "qmq compensator: error: 1 of 3 claimed row(s) not sent (retried=0 dead=1); "
        "each row's last_error says why"
    )
