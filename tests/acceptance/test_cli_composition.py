"""The ``qmq`` group loads a part's subcommand only when it runs: one without its extra's
libraries is the one-line "needs the extra" usage error, and the others still run.

Each case is a fresh interpreter in which the extra's library cannot be imported
(``sys.modules[name] = None``, as if it were not installed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

RUN = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from qmq_cli.main import main
main({args!r}, prog_name="qmq")
"""


def qmq(args: list[str], *, blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    code = RUN.format(blocked=blocked, args=args)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("command", "extra", "blocked"),
    [("broker", "broker", ("starlette",)), ("reconcile", "spark", ("pyspark",))],
)
def test_a_subcommand_without_its_extra_says_which_to_install(
    command: str, extra: str, blocked: tuple[str, ...]
) -> None:
    done = qmq([command, "--help"], blocked=blocked)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        f"qmq: error: {command} needs the '{extra}' extra: pip install 'qmq-outbox[{extra}]' ("
    )


def test_the_sdk_s_subcommands_run_without_the_broker_or_spark() -> None:
    done = qmq(["db", "--help"], blocked=("starlette", "uvicorn", "pyspark"))
    assert done.returncode == 0, done.stderr
    assert "upgrade" in done.stdout


def test_the_broker_starts_without_the_sdk_s_database_libraries() -> None:
    done = qmq(["broker", "--help"], blocked=("sqlalchemy", "alembic"))
    assert done.returncode == 0, done.stderr
    assert "--data-dir" in done.stdout
