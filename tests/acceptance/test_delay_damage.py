"""Issue 40, hole 1: damage in a delayed-message file never stops the broker.

Reported: one flipped bit in the header of any schedule, schedule-days, schedule-32days or
dispatch segment made the broker exit 1, ``--on-damage skip`` too, and took every subject
down. Against real broker processes, one flipped bit in each kind of file, in its header and
in a frame: the broker starts (a header needs ``--on-damage skip``, and the refusal without
it names the file and the flag), the other subject serves everything, no seq is reused, and
``verify`` counts the delayed messages lost exactly as the broker does.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from qmq_broker.delayed.tiers import Tiers
from qmq_broker.format import SegmentKind, iter_frames, list_segments
from qmq_broker.format.frames import FRAME_SIZE
from qmq_broker.format.schedule import ScheduleRecord
from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import Message, OutgoingMessage
from tests.support.broker_process import BrokerProcess, free_port

DAY = timedelta(days=1)
KINDS = [
    SegmentKind.SCHEDULE,
    SegmentKind.SCHEDULE_DAYS,
    SegmentKind.SCHEDULE_32DAYS,
    SegmentKind.DISPATCH,
]


def day_bucket_due(now: datetime) -> datetime:
    """A due time the broker puts in a day bucket (not an hour, not a 32-day span)."""
    tiers = Tiers(load_ahead_us=300_000_000)
    now_us = int(now.timestamp() * 1_000_000)
    for days in range(2, 40):
        due = now + days * DAY
        kind, _ = tiers.place(int(due.timestamp() * 1_000_000), now_us=now_us, moving_through={})
        if kind is SegmentKind.SCHEDULE_DAYS:
            return due
    raise AssertionError("no due time lands in a day bucket")


def populate(broker: BrokerProcess) -> None:
    """Stored and delayed messages of two subjects in every kind of delayed-message file."""
    now = datetime.now(UTC)
    later = now + timedelta(minutes=10)
    in_days = day_bucket_due(now)
    far = now + 200 * DAY
    with BrokerClient(broker.url) as client:
        for subject in ("victim", "bystander"):
            client.produce(
                [OutgoingMessage(id=f"{subject}-{i}", subject=subject, body=b"now") for i in (0, 1)]
            )
            soon = [
                OutgoingMessage(
                    id=f"{subject}-soon",
                    subject=subject,
                    body=b"soon",
                    deliver_at=now + timedelta(seconds=1),
                )
            ]
            waiting = [
                OutgoingMessage(
                    id=f"{subject}-{name}-{i}",
                    subject=subject,
                    body=f"{name} {i} ".encode() * 20,
                    deliver_at=due + timedelta(seconds=i),
                )
                for name, due in (("later", later), ("days", in_days), ("far", far))
                for i in (0, 1)
            ]
            assert {r.status for r in client.produce(soon + waiting)} == {"scheduled"}
    deadline = time.monotonic() + 60  # the soon messages' dispatch writes the dispatch file
    while missing := [kind.name for kind in KINDS if not list_segments(broker.data_dir, kind)]:
        assert time.monotonic() < deadline, f"no {missing} file: {broker.log_tail(20)}"
        time.sleep(0.1)


def flip_header(data_dir: Path, kind: SegmentKind) -> Path:
    path = list_segments(data_dir, kind)[0]
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01  # the magic
    path.write_bytes(bytes(data))
    return path


def flip_frame(data_dir: Path, kind: SegmentKind) -> Path:
    """A bit in the body of victim's first waiting record of the file (a dispatch file's
    first record)."""
    for path in list_segments(data_dir, kind):
        data = bytearray(path.read_bytes())
        for offset, payload in iter_frames(bytes(data), path=str(path)):
            if kind is not SegmentKind.DISPATCH:
                message = ScheduleRecord.decode(payload).message
                if message.subject != "victim" or message.id.endswith("-soon"):
                    continue
            data[offset + FRAME_SIZE + len(payload) - 3] ^= 0x10
            path.write_bytes(bytes(data))
            return path
    raise AssertionError(f"no record to damage in {kind.name}")


def run_verify(data_dir: Path) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "qmq_outbox", "broker", "verify", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout.splitlines()


def start_failing(data_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "qmq_outbox", "broker", "--data-dir", str(data_dir)]
    return subprocess.run(
        [*cmd, "--port", str(free_port())], capture_output=True, text=True, timeout=60, check=False
    )


def metric(broker: BrokerProcess, name: str) -> float:
    text = httpx.get(f"{broker.url}/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def drain(client: BrokerClient, subject: str) -> list[Message]:
    got: list[Message] = []
    while batch := client.pull(subject, "g", "c", max_messages=100, wait_ms=300):
        got += batch
        client.ack(subject, "g", "c", [m.seq for m in batch])
    return got


def scheduled(client: BrokerClient, subject: str) -> dict[str, Any]:
    stats: dict[str, Any] = client.subject(subject)["scheduled"]
    return stats


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["header", "frame"])
@pytest.mark.parametrize("kind", KINDS, ids=[k.name.lower() for k in KINDS])
def test_one_flipped_bit_in_a_delayed_file_never_stops_the_broker(
    tmp_path: Path, kind: SegmentKind, where: str
) -> None:
    data_dir = tmp_path / "data"
    broker = BrokerProcess(data_dir).start()
    try:
        populate(broker)
        with BrokerClient(broker.url) as client:
            before = {s: client.subject(s) for s in ("victim", "bystander")}
    finally:
        broker.terminate()

    flipped = (flip_header if where == "header" else flip_frame)(data_dir, kind)
    code, lines = run_verify(data_dir)
    assert code == 1, lines
    assert any(line.startswith(str(flipped)) for line in lines), lines
    lost_in_verify = sum("delayed message unreadable" in line for line in lines)
    dispatch_in_verify = sum("a dispatch record unreadable" in line for line in lines)

    extra: list[str] = []
    if where == "header":  # refused without the flag, naming the file and the flag
        done = start_failing(data_dir)
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert str(flipped) in last
        assert "bad magic" in last
        assert "--on-damage skip" in last
        extra = ["--on-damage", "skip"]
    restarted = BrokerProcess(data_dir, extra_args=extra).start()
    try:
        schedule = httpx.get(f"{restarted.url}/v1/schedule").json()
        lost = schedule["unreadable"]
        assert lost == lost_in_verify
        unreadable_dispatches = metric(
            restarted, "qmq_broker_schedule_unreadable_dispatch_records_total"
        )
        assert unreadable_dispatches == dispatch_in_verify
        expected_lost = 1 if where == "frame" and kind is not SegmentKind.DISPATCH else 0
        assert lost == expected_lost
        assert dispatch_in_verify == (where == "frame" and kind is SegmentKind.DISPATCH)

        with BrokerClient(restarted.url) as client:
            victim = scheduled(client, "victim")
            assert victim["unreadable"] == expected_lost
            assert victim["messages"] == before["victim"]["scheduled"]["messages"] - expected_lost
            assert scheduled(client, "bystander") == before["bystander"]["scheduled"]

            # a dispatch record lost: its messages go out again and are not stored twice
            deadline = time.monotonic() + 10
            while httpx.get(f"{restarted.url}/v1/schedule").json()["dispatch_lag_ms"] > 0:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            for subject in ("victim", "bystander"):
                got = drain(client, subject)
                assert sorted(m.id for m in got) == sorted(
                    [f"{subject}-0", f"{subject}-1", f"{subject}-soon"]
                )
                assert [m.seq for m in got] == [0, 1, 2]
                next_seq = before[subject]["next_seq"]
                assert client.subject(subject)["next_seq"] == next_seq
                new = client.produce(
                    [OutgoingMessage(id=f"{subject}-new", subject=subject, body=b"x")]
                )
                assert new[0].seq == next_seq  # no seq reused
    finally:
        restarted.stop()


def cut_after_dispatched(data_dir: Path, kind: SegmentKind) -> tuple[Path, int]:
    """Cut a schedule file at its first waiting record (not a dispatched ``-soon`` one), in
    the middle of that record's frame; how many waiting records that took."""
    for path in list_segments(data_dir, kind):
        waiting = [
            offset
            for offset, payload in iter_frames(path.read_bytes(), path=str(path))
            if not ScheduleRecord.decode(payload).message.id.endswith("-soon")
        ]
        if waiting:
            with open(path, "r+b") as handle:
                handle.truncate(waiting[0] + FRAME_SIZE + 3)
            return path, len(waiting)
    raise AssertionError(f"nothing waits in a {kind.name} file")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS[:3], ids=[k.name.lower() for k in KINDS[:3]])
def test_a_cut_delayed_file_counts_every_message_it_took(tmp_path: Path, kind: SegmentKind) -> None:
    """Hole 1's cut: the file itself no longer holds what followed the cut; its tally does.
    After a kill -9 and a cut below acknowledged records, verify and the broker count the
    same loss, and the stored messages and the next seqs are untouched."""
    data_dir = tmp_path / "data"
    broker = BrokerProcess(data_dir).start()
    try:
        populate(broker)
        deadline = time.monotonic() + 30
        while httpx.get(f"{broker.url}/v1/schedule").json()["dispatched"] < 2:
            assert time.monotonic() < deadline, "the -soon messages never went out"
            time.sleep(0.1)
        with BrokerClient(broker.url) as client:
            before = {s: client.subject(s) for s in ("victim", "bystander")}
        broker.kill9()
    finally:
        broker.stop()

    cut, taken = cut_after_dispatched(data_dir, kind)
    code, lines = run_verify(data_dir)
    assert code == 1, lines
    gone = [line for line in lines if line.startswith(str(cut)) and "delayed messages gone" in line]
    assert len(gone) == 1, lines
    counted = re.search(r"(\d+) delayed messages gone", gone[0])
    assert counted is not None, gone
    assert int(counted.group(1)) == taken, gone

    restarted = BrokerProcess(data_dir).start()  # no flag needed: a cut is not a bad header
    try:
        schedule = httpx.get(f"{restarted.url}/v1/schedule").json()
        assert schedule["unreadable"] == taken
        assert metric(restarted, "qmq_broker_schedule_unreadable_messages_total") == taken
        waiting_before = sum(before[s]["scheduled"]["messages"] for s in before)
        assert schedule["messages"] == waiting_before - taken
        with BrokerClient(restarted.url) as client:
            for subject in ("victim", "bystander"):
                got = drain(client, subject)
                assert sorted(m.id for m in got) == sorted(
                    [f"{subject}-0", f"{subject}-1", f"{subject}-soon"]
                )
                new = client.produce(
                    [OutgoingMessage(id=f"{subject}-new", subject=subject, body=b"x")]
                )
                assert new[0].seq == before[subject]["next_seq"]  # no seq reused
    finally:
        restarted.stop()
    code, lines = run_verify(data_dir)  # counted once: the next start does not count it again
    assert not any("delayed messages gone" in line for line in lines), lines
