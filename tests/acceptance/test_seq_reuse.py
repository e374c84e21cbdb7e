"""A message segment cut below acknowledged data: counted, never a reused seq (real brokers).

Each test has a real broker store acknowledged messages, stops it (``kill -9`` before its
next checkpoint, or a clean stop), cuts a message segment, runs ``qmq broker verify`` and
restarts the broker. Then: the broker starts, a subject whose records lie elsewhere serves
all of them, the damaged subject serves every record before the cut and dead-letters the
rest as ``unreadable record``, that count equals verify's, the next message gets a seq
above every seq handed out before, and a resend of a lost message is stored again (once) while
a resend of a kept one is a ``duplicate`` with its own seq.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from qmq_broker.format import SegmentKind, iter_frames, list_segments
from qmq_broker.format.messages import peek_message
from tests.support.broker_process import BrokerProcess, free_port

BODY = "b" * 1_500
PATIENT = ["--checkpoint-interval", "1h", "--segment-size", "1048576"]


def produce(url: str, subject: str, ids: range, *, body: str = BODY) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for start in range(ids.start, ids.stop, 100):
        batch = [
            {"id": f"{subject}-{i}", "subject": subject, "body": f"{i}:{body}"}
            for i in range(start, min(start + 100, ids.stop))
        ]
        answer = httpx.post(f"{url}/v1/messages", json={"messages": batch}, timeout=30)
        assert answer.status_code == 200, answer.text
        results += answer.json()["results"]
    return results


def drain(url: str, subject: str, group: str) -> list[dict[str, Any]]:
    """Everything a group can pull, each batch acked with the next pull."""
    served: list[dict[str, Any]] = []
    ack: list[int] = []
    while True:
        request: dict[str, Any] = {"subject": subject, "group": group, "consumer": "c", "max": 500}
        if ack:
            request["ack"] = ack
        answer = httpx.post(f"{url}/v1/pull", json=request, timeout=30)
        assert answer.status_code == 200, answer.text
        batch = answer.json()["messages"]
        if not batch:
            return served
        served += batch
        ack = [m["seq"] for m in batch]


def dead(url: str, subject: str, group: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after: int | None = None
    while True:
        query = {"limit": "1000", **({"after_seq": str(after)} if after is not None else {})}
        answer = httpx.get(f"{url}/v1/subjects/{subject}/groups/{group}/dead", params=query)
        assert answer.status_code == 200, answer.text
        found += answer.json()["dead"]
        after = answer.json()["next_after_seq"]
        if after is None:
            return found


def verify(data_dir: Path) -> tuple[int, str]:
    """``qmq broker verify``: (messages it counts unreadable, its output)."""
    done = subprocess.run(
        [sys.executable, "-m", "qmq_outbox", "broker", "verify", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    found = re.search(r", (\d+) messages unreadable \(", done.stdout)
    return (int(found.group(1)) if found else 0), done.stdout


def frame_starts(path: Path) -> list[int]:
    return [offset for offset, _ in iter_frames(path.read_bytes(), path=str(path))]


def frame_of(path: Path, subject: str, seq: int) -> int:
    for offset, payload in iter_frames(path.read_bytes(), path=str(path)):
        if peek_message(payload)[::2] == (seq, subject):
            return offset
    raise AssertionError(f"{subject} seq {seq} not in {path}")


def check_after(
    broker: BrokerProcess, subject: str, stored: list[dict[str, Any]], expected_lost: int
) -> set[int]:
    """The damaged subject serves or dead-letters each seq once, no seq is reused; returns
    the seqs dead-lettered."""
    served = drain(broker.url, subject, "fresh")
    buried = dead(broker.url, subject, "fresh")
    by_seq = {r["seq"]: r["id"] for r in stored}
    assert len({m["seq"] for m in served}) == len(served), "a seq served twice"
    for m in served:
        assert by_seq[m["seq"]] == m["id"], "a seq now names another message"
        assert m["body"].startswith(f"{m['id'].rsplit('-', 1)[1]}:"), "a wrong body"
    lost = {d["seq"] for d in buried}
    assert {d["error"] for d in buried} <= {"unreadable record"}
    assert lost | {m["seq"] for m in served} == set(by_seq), "a seq neither served nor counted"
    assert len(lost) == expected_lost
    top = max(by_seq)
    fresh_ids = range(10**6, 10**6 + 3)
    again = produce(broker.url, subject, fresh_ids)
    assert [r["status"] for r in again] == ["stored"] * 3
    assert min(r["seq"] for r in again) > top, "a seq handed out again"
    for seq in sorted(lost)[:1]:  # a lost message's resend is stored anew, once
        index = int(by_seq[seq].rsplit("-", 1)[1])
        resent = produce(broker.url, subject, range(index, index + 1))[0]
        assert resent["status"] == "stored", resent
        assert resent["seq"] > top, resent
        again = produce(broker.url, subject, range(index, index + 1))[0]
        assert again == {**resent, "status": "duplicate"}, again
    kept = next(m for m in served)
    index = int(kept["id"].rsplit("-", 1)[1])
    resent = produce(broker.url, subject, range(index, index + 1))[0]
    assert resent == {**resent, "status": "duplicate", "seq": kept["seq"]}
    return lost


def test_active_segment_cut_below_acknowledged_data_after_kill_9(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    broker = BrokerProcess(data_dir, extra_args=PATIENT).start()
    try:
        produce(broker.url, "other", range(1_000))  # fills the first segment and rolls
        stored = produce(broker.url, "orders", range(200))
        assert all(r["status"] == "stored" for r in stored)
        broker.kill9()  # before its next checkpoint: every orders record lies past it
    finally:
        broker.stop()
    active = list_segments(data_dir, SegmentKind.MESSAGES)[-1]
    with open(active, "r+b") as handle:  # inside seq 81's frame: 119 acked records cut off
        handle.truncate(frame_of(active, "orders", 81) + 100)
    counted, report = verify(data_dir)
    assert counted == 119, report

    restarted = BrokerProcess(data_dir, extra_args=PATIENT).start()
    try:
        assert [m["id"] for m in drain(restarted.url, "other", "fresh")] == [
            f"other-{i}" for i in range(1_000)
        ]
        lost = check_after(restarted, "orders", stored, counted)
        assert lost == set(range(200 - counted, 200))
        log = restarted.log_path.read_text()
        assert f"orders: {counted} stored messages lost, seqs {200 - counted}..199" in log
        metrics = httpx.get(f"{restarted.url}/metrics").text
        assert re.search(rf"^qmq_broker_unreadable_messages_total {counted}\.0$", metrics, re.M)
    finally:
        restarted.stop()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stop", ["kill -9", "clean stop"])
def test_a_cut_sealed_segment_costs_only_its_cut_records(
    tmp_path: Path, stop: str, seed: int
) -> None:
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    broker = BrokerProcess(data_dir, extra_args=PATIENT).start()
    try:
        produce(broker.url, "other", range(300))
        stored = produce(broker.url, "orders", range(2_000))  # segments of their own
        produce(broker.url, "other", range(300, 600))
        if stop == "kill -9":
            broker.kill9()
        else:
            assert broker.terminate() == 0
    finally:
        broker.stop()
    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    orders_only = segments[1:-1]
    assert len(orders_only) >= 2
    sealed = rng.choice(orders_only)
    cut = rng.randrange(16, sealed.stat().st_size)
    if seed == 0:
        cut = frame_starts(sealed)[5]  # on a frame boundary: no torn frame marks the cut
    with open(sealed, "r+b") as handle:
        handle.truncate(cut)
    counted, report = verify(data_dir)
    assert counted > 0, report

    restarted = BrokerProcess(data_dir, extra_args=PATIENT).start()
    try:
        assert [m["id"] for m in drain(restarted.url, "other", "fresh")] == [
            f"other-{i}" for i in range(600)
        ]
        check_after(restarted, "orders", stored, counted)
    finally:
        restarted.stop()


def test_a_missing_segment_refusal_names_the_file_and_the_command(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    broker = BrokerProcess(data_dir, extra_args=PATIENT).start()
    try:
        stored = produce(broker.url, "orders", range(2_000))
        assert broker.terminate() == 0
    finally:
        broker.stop()
    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    segments[1].unlink()
    counted, report = verify(data_dir)
    assert str(segments[1]) in report
    assert counted > 0, report
    command = [sys.executable, "-m", "qmq_outbox", "broker", "--data-dir", str(data_dir)]
    refused = subprocess.run(
        [*command, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 1, refused.stdout + refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "missing between others" in line, line
    assert str(data_dir / "messages") in line, line
    assert f"qmq broker --data-dir {data_dir} --on-damage skip" in line, line

    skipping = BrokerProcess(data_dir, extra_args=[*PATIENT, "--on-damage", "skip"]).start()
    try:
        check_after(skipping, "orders", stored, counted)
    finally:
        skipping.stop()
