"""A clean install (issue 36 item 7): the built wheel, installed into a fresh virtualenv.

The wheel is built from a copy of the checkout, installed with the ``broker`` and
``postgres`` extras (dependencies from the configured index, through pip's cache), and run
from a directory outside the checkout, so that nothing is imported from the source tree.
The newest FastAPI is installed beside it, as in an application, and pip must find their
requirements compatible. The wheel installs only the five ``qmq_*`` top-level names, none
an application could own (``broker``, ``migrations``), and ``qmq`` runs the broker (on the
Starlette FastAPI pulled) and migrates a fresh database.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from qmq_outbox.migrate import VERSION_TABLE
from tests.support.broker_process import free_port
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("qmq_outbox", "qmq_wire", "qmq_broker", "qmq_reconcile", "qmq_cli")
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QMQ_", "PYTHON"))}
    done = subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the wheel installed with ``[broker,postgres]``."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:  # a copy: building in the checkout would write its build/
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", work / "dist", source, cwd=work)
    (wheel,) = (work / "dist").glob("qmq_outbox-*.whl")
    run(sys.executable, "-m", "venv", work / "venv", cwd=work)
    python = work / "venv" / "bin" / "python"
    # beside the newest FastAPI, as in an application: the broker runs on the Starlette that
    # FastAPI pulls; --no-compile: byte-compiling every dependency is most of the install
    install = ("install", "--no-compile", f"{wheel}[broker,postgres]", "fastapi")
    run(python, "-m", "pip", *install, cwd=work, timeout=500)
    run(python, "-m", "pip", "check", cwd=work)
    return work / "venv"


def test_the_wheel_installs_only_qmq_top_level_names(venv: Path) -> None:
    listed = run(
        venv / "bin" / "python",
        "-c",
        "import importlib.metadata as m; d = m.distribution('qmq-outbox');"
        "print(d.read_text('top_level.txt'));"
        "print('\\n'.join(str(f) for f in d.files))",
        cwd=venv,
    ).stdout.split("\n\n", 1)
    top_level, files = listed[0].split(), listed[1].split()
    assert sorted(top_level) == sorted(PACKAGES)
    installed = {f.split("/")[0] for f in files if not f.startswith("..")}
    assert installed == {*PACKAGES, "qmq_outbox-0.1.0.dist-info"}
    assert any(f.startswith("qmq_outbox/migrations/versions/") for f in files)

    where = run(
        venv / "bin" / "python", "-c", "import qmq_broker; print(qmq_broker.__file__)", cwd=venv
    )
    assert where.stdout.startswith(str(venv))


def test_qmq_version(venv: Path) -> None:
    shown = run(venv / "bin" / "qmq", "--version", cwd=venv)
    assert shown.stdout.strip() == "qmq, version 0.1.0"


def test_qmq_broker_serves(venv: Path, tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "broker.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QMQ_", "PYTHON"))}
    command = [venv / "bin" / "qmq", "broker", "--data-dir", tmp_path / "data", "--port", port]
    broker = subprocess.Popen(
        [str(arg) for arg in command],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        assert _healthy(f"http://127.0.0.1:{port}/healthz", broker), (
            tmp_path / "broker.log"
        ).read_text()
        broker.terminate()
        assert broker.wait(30) == 0
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait(10)


def test_qmq_db_upgrade(venv: Path, pg_admin_url: str, tmp_path: Path) -> None:
    with fresh_database(pg_admin_url, prefix="qmq_wheel") as url:
        run(venv / "bin" / "qmq", "db", "upgrade", "--database-url", url, cwd=tmp_path)
        engine = sa.create_engine(url)
        try:
            tables = set(sa.inspect(engine).get_table_names())
        finally:
            engine.dispose()
    assert {"qmq_outbox", "qmq_consumed", VERSION_TABLE} <= tables


def _healthy(url: str, process: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False
