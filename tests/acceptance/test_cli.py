"""The `qmq` command: help reads well, bad input is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


def qmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq_outbox", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_command_and_env_vars() -> None:
    top = qmq("--help")
    assert top.returncode == 0
    for command in ("broker", "compensator", "db", "reconcile"):
        assert command in top.stdout
    assert "--debug" in top.stdout
    assert "QMQ_DEBUG" in top.stdout
    for command, var in [
        ("broker", "QMQ_BROKER_FSYNC"),
        ("compensator", "QMQ_COMPENSATOR_BROKER_URL"),
        ("reconcile", "QMQ_RECONCILE_JARS"),
    ]:
        helped = qmq(command, "--help")
        assert helped.returncode == 0
        assert var in helped.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["broker", "--data-dir", "/tmp/x", "--fsync", "sometimes"], "fsync policy"),
        (["broker", "--data-dir", "/tmp/x", "--retention", "5x"], "--retention"),
        (["broker", "--no-such-flag"], "--no-such-flag"),
        (["broker", "--data-dir", "/tmp/x", "--time-slice-ms", "0"], "--time-slice-ms"),
        (["compensator", "--broker-url", "http://127.0.0.1:1"], "--database-url"),
        (["db", "downgrade", "--database-url", "sqlite://"], "--revision"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = qmq(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]
    assert lines[0].startswith("qmq")
