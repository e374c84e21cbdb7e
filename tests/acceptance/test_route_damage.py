"""Damaged route tables (docs/architecture.md 3.6) against real broker processes.

A real broker writes one data directory: an ordered subject split and merged (its route
table at version 3), a second ordered subject and a plain one; each test damages a copy of
its route table (one flipped bit, a truncation) and starts brokers and ``qmq broker verify``
on it as processes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from qmq_broker.ordered.files import declaration_path, read_table, table_path
from tests.support.broker_process import BrokerProcess, free_port

SUBJECT = "orders.changed"
OTHER = "ledger.entries"
PLAIN = "audit.plain"
GROUP = "readers"


def call(http: httpx.Client, method: str, path: str, body: Any = None, status: int = 200) -> Any:
    response = http.request(method, path, json=body)
    assert response.status_code == status, (method, path, body, response.text)
    return response.json()


def produce(http: httpx.Client, subject: str, ids: range, *, keyed: bool = True) -> None:
    messages = [
        {"id": f"{subject}-{n}", "subject": subject, "body": f"n={n}"}
        | ({"key": f"key-{n % 17}"} if keyed else {})
        for n in ids
    ]
    results = call(http, "POST", "/v1/messages", {"messages": messages})["results"]
    assert {r["status"] for r in results} == {"stored"}


def pull_and_ack(http: httpx.Client, subject: str, *, ordered: bool) -> int:
    """Pull once and ack what came: how many messages."""
    body = {"subject": subject, "group": GROUP, "consumer": "c1", "max": 100}
    if ordered:
        body["mode"] = "ordered"
    messages = call(http, "POST", "/v1/pull", body)["messages"]
    by_partition: dict[int | None, list[int]] = {}
    for message in messages:
        by_partition.setdefault(message.get("partition"), []).append(message["seq"])
    for partition, seqs in by_partition.items():
        ack = {"subject": subject, "group": GROUP, "consumer": "c1", "seqs": seqs}
        if partition is not None:
            ack["partition"] = partition
        call(http, "POST", "/v1/ack", ack)
    return len(messages)


def routes_of(url: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=10) as http:
        doc: dict[str, Any] = call(http, "GET", f"/v1/subjects/{SUBJECT}/routes")
    return {key: doc[key] for key in ("version", "ranges", "history", "on_dead")}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A data directory a real broker wrote and shut down cleanly, and the subject's routes."""
    data_dir = tmp_path_factory.mktemp("routes") / "data"
    broker = BrokerProcess(data_dir).start()
    try:
        with httpx.Client(base_url=broker.url, timeout=10) as http:
            body = {"ordered": True, "partitions": 2, "on_dead": "block"}
            call(http, "PUT", f"/v1/subjects/{SUBJECT}", body)
            call(http, "PUT", f"/v1/subjects/{OTHER}", {"ordered": True, "partitions": 1})
            produce(http, SUBJECT, range(40))
            call(
                http,
                "POST",
                f"/v1/subjects/{SUBJECT}/partitions/split",
                {"partition": 0, "at": 256},
            )
            produce(http, SUBJECT, range(40, 80))
            call(http, "POST", f"/v1/subjects/{SUBJECT}/partitions/merge", {"partitions": [2, 3]})
            produce(http, SUBJECT, range(80, 120))
            produce(http, OTHER, range(20))
            produce(http, PLAIN, range(20), keyed=False)
        original = routes_of(broker.url)
        assert original["version"] == 3
        assert broker.terminate() == 0
    finally:
        broker.stop()
    return data_dir, original


@pytest.fixture
def data_dir(written: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(written[0], copy)
    return copy


@pytest.fixture
def original(written: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    return written[1]


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = pytest.mark.parametrize("damage", [flip_a_bit, cut], ids=["flipped bit", "truncated"])


def qmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq_outbox", "broker", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def refused(data_dir: Path) -> str:
    """Start a broker that must refuse: its one line on stderr."""
    done = qmq("--data-dir", str(data_dir), "--port", str(free_port()))
    assert done.returncode == 1, done.stderr
    return done.stderr.strip().splitlines()[-1]


def assert_every_subject_serves(url: str, *, fenced: bool = False) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        assert pull_and_ack(http, OTHER, ordered=True) > 0
        assert pull_and_ack(http, PLAIN, ordered=False) == 20
        produce(http, OTHER, range(100, 105))
        produce(http, PLAIN, range(100, 105), keyed=False)
        if not fenced:
            assert pull_and_ack(http, SUBJECT, ordered=True) > 0
            produce(http, SUBJECT, range(500, 510))


@DAMAGE
def test_refused_by_default_then_verify_names_it_and_repair_rebuilds_it(
    data_dir: Path, original: dict[str, Any], damage: Any
) -> None:
    table = table_path(data_dir, SUBJECT)
    damage(table)

    line = refused(data_dir)
    assert f"{table}: route table does not check out" in line
    assert f"qmq broker verify --data-dir {data_dir} --repair" in line
    assert "--on-damage skip" in line

    checked = qmq("verify", "--data-dir", str(data_dir))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"{table} at 0: route table does not check out" in checked.stdout
    assert "--repair rebuilds it" in checked.stdout

    repaired = qmq("verify", "--data-dir", str(data_dir), "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert f"repaired: rewrote {table}" in repaired.stdout
    assert read_table(table).sealed

    broker = BrokerProcess(data_dir).start()
    try:
        assert routes_of(broker.url) == original
        assert_every_subject_serves(broker.url)
    finally:
        broker.stop()


@DAMAGE
def test_on_damage_skip_rebuilds_it_at_start(
    data_dir: Path, original: dict[str, Any], damage: Any
) -> None:
    table = table_path(data_dir, SUBJECT)
    damage(table)
    broker = BrokerProcess(data_dir, extra_args=["--on-damage", "skip"]).start()
    try:
        assert routes_of(broker.url) == original
        assert_every_subject_serves(broker.url)
        assert "rebuilt from its declaration" in broker.log_tail(200)
    finally:
        broker.stop()
    assert read_table(table).routes.current.version == 3
    assert qmq("verify", "--data-dir", str(data_dir)).returncode == 0


@DAMAGE
def test_a_table_that_cannot_be_rebuilt_fences_its_subject_alone(
    data_dir: Path, damage: Any
) -> None:
    table = table_path(data_dir, SUBJECT)
    damage(table)
    declaration_path(data_dir, SUBJECT).unlink()  # nothing left to rebuild version 1 from

    line = refused(data_dir)
    assert f"{table}: route table does not check out" in line
    assert "cannot be rebuilt" in line
    assert f"--on-damage skip to serve the rest with {SUBJECT!r} fenced" in line

    for flags in ((), ("--repair",)):
        checked = qmq("verify", "--data-dir", str(data_dir), *flags)
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert f"{table} at 0: route table does not check out" in checked.stdout
        assert "restore it from a backup" in checked.stdout

    sampled = ["--console-sample-interval", "100ms"]
    broker = BrokerProcess(data_dir, extra_args=["--on-damage", "skip", *sampled]).start()
    try:
        with httpx.Client(base_url=broker.url, timeout=10) as http:
            who = {"group": GROUP, "consumer": "c1"}
            message = {"id": "x", "subject": SUBJECT, "key": "k", "body": "b"}
            fenced = [
                ("POST", "/v1/messages", {"messages": [message]}, "messages[0].subject"),
                ("POST", "/v1/pull", {"subject": SUBJECT, **who, "mode": "ordered"}, "subject"),
                ("POST", "/v1/pull", {"subject": SUBJECT, **who}, "subject"),  # shared mode
                ("GET", f"/v1/subjects/{SUBJECT}/routes", None, "subject"),
                ("PUT", f"/v1/subjects/{SUBJECT}", {"ordered": True, "partitions": 2}, "subject"),
                ("POST", f"/v1/subjects/{SUBJECT}/partitions/move", {"partition": 1}, "subject"),
                (
                    "POST",
                    "/v1/ack",
                    {"subject": SUBJECT, **who, "partition": 1, "seqs": [0]},
                    "subject",
                ),
            ]
            for method, path, body, field in fenced:
                error = call(http, method, path, body, status=503)["error"]
                assert error["code"] == "subject_fenced", (path, error)
                assert error["field"] == field
                assert f"ordered/{SUBJECT}.json" in error["message"]
            # Read-only: still listed and counted, on the console too, its data untouched.
            listed = call(http, "GET", "/v1/subjects")["subjects"]
            assert [s["messages"] for s in listed if s["subject"] == SUBJECT] == [120]
            assert call(http, "GET", f"/v1/subjects/{SUBJECT}")["messages"] == 120
            assert SUBJECT in json.dumps(call(http, "GET", "/v1/console/overview"))
            call(http, "GET", f"/v1/console/subjects/{SUBJECT}")
        assert_every_subject_serves(broker.url, fenced=True)
        time.sleep(0.5)  # a few console samples, which read every subject
        assert httpx.get(f"{broker.url}/healthz", timeout=5).status_code == 200
    finally:
        broker.stop()


def test_a_bare_format_1_table_is_read_and_rewritten_sealed(
    data_dir: Path, original: dict[str, Any]
) -> None:
    table = table_path(data_dir, SUBJECT)
    table.write_bytes(orjson.dumps(orjson.loads(table.read_bytes())["table"]))
    declaration_path(data_dir, SUBJECT).unlink()  # as in a data directory from before them
    assert qmq("verify", "--data-dir", str(data_dir)).returncode == 0

    broker = BrokerProcess(data_dir).start()
    try:
        assert routes_of(broker.url) == original
    finally:
        broker.stop()
    assert orjson.loads(table.read_bytes())["format"] == 2
    assert read_table(table).sealed
    assert declaration_path(data_dir, SUBJECT).exists()
    assert qmq("verify", "--data-dir", str(data_dir)).returncode == 0
