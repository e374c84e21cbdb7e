"""``qmq subject``: declare an ordered subject and change its partitions from the command line,
as a process against a real broker; a refused call is one line with its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmq_outbox import BrokerClient
from tests.support.broker_process import BrokerProcess, free_port

pytestmark = pytest.mark.timeout(120)


def qmq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QMQ_")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "qmq_outbox", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path_factory.mktemp("cli-subject") / "data")
    process.start()
    yield process
    process.stop()


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


def test_each_subcommand_against_a_broker(broker: BrokerProcess) -> None:
    url = broker.url
    created = ok(
        qmq("subject", "create", "ledger.a", "--ordered", "--partitions", "2", "--broker-url", url)
    )
    assert created.splitlines() == [
        "subject ledger.a: ordered, route version 1, on_dead skip, 1024 logic partitions",
        "  logic range    partition",
        "  [0, 512)       0",
        "  [512, 1024)    1",
        "history:",
        "  v1   create closed -        0-512:0 512-1024:1",
        "groups: none yet",
    ]
    again = qmq(
        "subject", "create", "ledger.a", "--ordered", "--partitions", "2", "--broker-url", url
    )
    assert ok(again) == created  # the same declaration changes nothing

    split = ok(
        qmq("subject", "split", "ledger.a", "--partition", "0", "--at", "256", "--broker-url", url)
    )
    assert "subject ledger.a: ordered, route version 2," in split
    assert "  [0, 256)       2\n  [256, 512)     3\n  [512, 1024)    1\n" in split
    assert "  v2   split  closed 0        0-256:2 256-512:3 512-1024:1" in split

    merged = ok(qmq("subject", "merge", "ledger.a", "--partitions", "2", "3", "--broker-url", url))
    assert "route version 3," in merged
    assert "  v3   merge  closed 2, 3     0-512:4 512-1024:1" in merged

    # A group appears once it pulled: the partitions closed so far held nothing but their
    # commands, so it is at version 3 (partition 1, closed by the move, it has not seen yet).
    with BrokerClient(url) as client:
        assert client.pull("ledger.a", "billing", "c1", mode="ordered") == []
    moved = ok(
        qmq(
            "subject",
            "move",
            "ledger.a",
            "--partition",
            "1",
            "--json",
            env={"QMQ_SUBJECT_BROKER_URL": url},
        )
    )
    document = json.loads(moved)
    assert document["version"] == 4
    assert document["ranges"] == [
        {"lo": 0, "hi": 512, "partition": 4},
        {"lo": 512, "hi": 1024, "partition": 5},
    ]
    assert [(v["change"], v["closed"]) for v in document["history"]] == [
        ("create", []),
        ("split", [0]),
        ("merge", [2, 3]),
        ("move", [1]),
    ]
    assert document["groups"] == [{"group": "billing", "version": 3}]

    shown = ok(qmq("subject", "routes", "ledger.a", "--broker-url", url))
    assert shown.splitlines()[0].startswith("subject ledger.a: ordered, route version 4,")
    assert shown.splitlines()[-2:] == ["groups:", "  billing                  version 3"]
    assert (
        json.loads(ok(qmq("subject", "routes", "ledger.a", "--json", "--broker-url", url)))
        == document
    )

    blocking = ok(
        qmq("subject", "create", "ledger.b", "--ordered", "--on-dead", "block", "--broker-url", url)
    )
    assert "on_dead block" in blocking.splitlines()[0]
    assert "  [0, 1024)      0" in blocking


def test_refused_calls_are_one_line_with_their_exit_code(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    url = broker.url
    ok(qmq("subject", "create", "ledger.c", "--ordered", "--partitions", "2", "--broker-url", url))
    with BrokerClient(url) as client:  # a subject that stored messages unordered
        client.pull("plain.c", "g", "c1")

    unknown = one_line(qmq("subject", "routes", "nosuch", "--broker-url", url), 2)
    assert unknown == (
        f"qmq subject routes: error: {url}: "
        "broker answered 404 subject_not_found (subject): no subject 'nosuch'"
    )
    conflict = one_line(
        qmq("subject", "create", "ledger.c", "--ordered", "--partitions", "3", "--broker-url", url),
        2,
    )
    assert conflict.startswith(
        f"qmq subject create: error: {url}: broker answered 409 subject_conflict (partitions): "
    )
    unordered = one_line(qmq("subject", "create", "plain.c", "--ordered", "--broker-url", url), 2)
    assert "409 subject_conflict (subject)" in unordered
    not_ordered = one_line(qmq("subject", "routes", "plain.c", "--broker-url", url), 2)
    assert "409 not_ordered" in not_ordered
    bad_split = one_line(
        qmq("subject", "split", "ledger.c", "--partition", "7", "--at", "10", "--broker-url", url),
        2,
    )
    assert "409 route_conflict (partition)" in bad_split
    not_adjacent = one_line(
        qmq("subject", "merge", "ledger.c", "--partitions", "0", "0", "--broker-url", url), 2
    )
    assert "409 route_conflict" in not_adjacent

    unreachable = f"http://127.0.0.1:{free_port()}"
    refused = one_line(qmq("subject", "routes", "ledger.c", "--broker-url", unreachable), 3)
    assert refused == (
        f"qmq subject routes: error: cannot reach broker at {unreachable}: connection refused"
    )
    moved = one_line(
        qmq("subject", "move", "ledger.c", "--partition", "0", "--broker-url", unreachable), 3
    )
    assert moved.startswith("qmq subject move: error: cannot reach broker at ")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["create", "ledger.d"], "give --ordered"),
        (["create", "ledger.d", "--ordered", "--partitions", "65"], "--partitions"),
        (["create", "ledger.d", "--ordered", "--on-dead", "later"], "--on-dead"),
        (["routes", "bad name"], "is not a subject name"),
        (["routes", "_qmq.x"], "is not a subject name"),
        (["split", "ledger.d", "--partition", "0"], "--at"),
        (["split", "ledger.d", "--partition", "0", "--at", "1024"], "--at"),
        (["merge", "ledger.d", "--partitions", "1"], "--partitions"),
        (["move", "ledger.d"], "--partition"),
    ],
)
def test_bad_input_is_refused_before_any_request(args: list[str], needle: str) -> None:
    # an unreachable broker: none of these may get as far as calling it (that would be exit 3)
    result = qmq("subject", *args, "--broker-url", f"http://127.0.0.1:{free_port()}")
    line = one_line(result, 2)
    assert line.startswith(f"qmq subject {args[0]}: error: ")
    assert needle in line


def test_a_bad_broker_url_is_a_usage_error() -> None:
    line = one_line(qmq("subject", "routes", "ledger.e", "--broker-url", "ftp://x"), 2)
    assert "'--broker-url'" in line
    assert "is not a broker URL" in line


def test_help_lists_the_subcommands_and_their_env_vars() -> None:
    top = ok(qmq("--help"))
    assert "subject" in top
    listed = ok(qmq("subject", "--help"))
    for name in ("create", "routes", "split", "merge", "move"):
        assert name in listed
    assert "QMQ_SUBJECT_BROKER_URL" in ok(qmq("subject", "create", "--help"))
