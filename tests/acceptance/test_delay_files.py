"""Issue 13, item 9: delayed-message files grow with the messages, not with the horizon.

Reported: delayed messages one an hour up to two years ahead made 17,400 schedule files, 69
MB on disk for 1.5 MB of payload (a file per occupied hour, a disk block each). Against real
broker processes: the file count and disk use of such schedules, delivery on time after a
kill -9, and a kill -9 in the middle of moving a coarse bucket into hours.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from qmq_broker.delayed.tiers import Tiers
from qmq_broker.format import SegmentKind, iter_message_records, list_segments
from qmq_broker.format.schedule import COARSE_SCHEDULE_KINDS
from qmq_broker.storage.segments import segment_path
from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import Message, OutgoingMessage
from tests.support.broker_process import BrokerProcess

TWO_YEARS = timedelta(days=729, hours=23)  # --max-delay is 730 days
LATE_MAX = 1.0  # seconds after its due time (or the restart) a message may arrive


def on_disk(data_dir: Path) -> tuple[int, int, int]:
    """Files, their bytes, and the bytes the file system allocated for them."""
    files = [p for p in data_dir.rglob("*") if p.is_file()]
    stats = [p.stat() for p in files]
    return len(files), sum(s.st_size for s in stats), sum(s.st_blocks * 512 for s in stats)


def produce(client: BrokerClient, messages: list[OutgoingMessage]) -> None:
    for first in range(0, len(messages), 1000):
        results = client.produce(messages[first : first + 1000])
        assert {r.status for r in results} == {"scheduled"}


def schedule(broker: BrokerProcess, limit: int) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"{broker.url}/v1/schedule?limit={limit}").json()
    return doc


def hour_of(due: datetime | None) -> str:
    assert due is not None
    return due.astimezone(UTC).strftime("%Y-%m-%dT%H:00:00.000000Z")


def spread(count: int, *, subject: str, body: bytes) -> list[OutgoingMessage]:
    """``count`` messages due from an hour to two years ahead, evenly spaced."""
    now = datetime.now(UTC)
    step = (TWO_YEARS - timedelta(hours=1)) / (count - 1)
    return [
        OutgoingMessage(
            id=f"far-{i}",
            subject=subject,
            body=body,
            deliver_at=now + timedelta(hours=1) + step * i,
        )
        for i in range(count)
    ]


def test_eighteen_messages_from_an_hour_to_two_years_ahead_take_a_file_each_at_most(
    broker: BrokerProcess,
) -> None:
    payload = 18 * 83_000  # 1.5 MB, as reported
    with BrokerClient(broker.url) as client:
        produce(client, spread(18, subject="far", body=b"x" * 83_000))
        assert client.subject("far")["scheduled"]["messages"] == 18
    files, size, allocated = on_disk(broker.data_dir)
    assert files <= 18 + 4, files  # FORMAT, checkpoints
    assert size <= payload * 1.02 + 64 * 1024, size
    assert allocated <= size + files * 8192, allocated


def test_one_message_an_hour_for_two_years_takes_tens_of_files_not_17400(
    broker: BrokerProcess,
) -> None:
    count = 17_400  # one an hour for 725 days
    now = datetime.now(UTC)
    messages = [
        OutgoingMessage(
            id=f"h-{i}", subject="hourly", body=b"x" * 86, deliver_at=now + timedelta(hours=i + 1)
        )
        for i in range(count)
    ]
    with BrokerClient(broker.url) as client:
        produce(client, messages)
        assert client.subject("hourly")["scheduled"]["messages"] == count
    waiting = schedule(broker, limit=2)
    assert waiting["messages"] == count
    assert [h["hour"] for h in waiting["hours"]] == [hour_of(m.deliver_at) for m in messages[:2]]
    assert waiting["more_hours"]
    files, size, allocated = on_disk(broker.data_dir)
    # hours of today and tomorrow, days of this 32-day span (and of the next once its move
    # came: then this one has a day or two left), 32-day spans: not a file per hour
    assert files <= 48 + 34 + 24 + 4, files
    assert size <= 4 * 1024 * 1024, size  # 1.5 MB of bodies in ~180-byte records
    assert allocated <= 8 * 1024 * 1024, allocated  # reported: 69 MB


def test_after_kill_9_due_messages_arrive_on_time_and_far_ones_still_wait(
    broker: BrokerProcess,
) -> None:
    far = spread(18, subject="orders", body=b"x" * 83_000)
    start = datetime.now(UTC)
    soon = [
        OutgoingMessage(
            id=f"soon-{i}",
            subject="orders",
            body=f"b{i}".encode(),
            deliver_at=start + timedelta(seconds=3 + i * 0.1),
        )
        for i in range(20)
    ]
    with BrokerClient(broker.url) as client:
        produce(client, far + soon)
    files_before = on_disk(broker.data_dir)[0]
    broker.kill9()
    broker.restart()
    healthy_at = time.time()
    arrived: list[tuple[float, Message]] = []
    with BrokerClient(broker.url) as client:
        deadline = time.monotonic() + 15
        while len(arrived) < len(soon) and time.monotonic() < deadline:
            got = client.pull("orders", "g", "c", max_messages=100, wait_ms=200)
            arrived += [(time.time(), m) for m in got]
            if got:
                client.ack("orders", "g", "c", [m.seq for m in got])
    after = schedule(broker, limit=50)
    assert sorted(m.id for _, m in arrived) == sorted(m.id for m in soon)
    dues = {m.id: m.deliver_at for m in soon}
    for at, message in arrived:
        due = dues[message.id]
        assert due is not None
        assert message.stored_at is not None
        assert message.stored_at >= due, message.id  # never early
        assert at - max(due.timestamp(), healthy_at) <= LATE_MAX, message.id
    assert after["messages"] == 18
    assert [h["hour"] for h in after["hours"]] == [hour_of(m.deliver_at) for m in far]
    assert [h["messages"] for h in after["hours"]] == [1] * 18
    # a message segment, an index chunk, the subject's dedup filter, and the like
    assert on_disk(broker.data_dir)[0] <= files_before + 5


# --- kill -9 while a day bucket is moved into its hours --------------------------------------


def child(data_dir: Path, offset_s: float, *args: object) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.support.delayed_child", str(data_dir), str(offset_s)]
    return subprocess.Popen(
        [*cmd, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


def day_bucket_ahead(now_us: int, tiers: Tiers) -> int:
    """The first UTC day (from the day after tomorrow) whose messages go to a day bucket."""
    day = now_us // (24 * 3600 * 1_000_000) + 2
    while tiers.place(day * 24 * 3600 * 1_000_000, now_us=now_us, moving_through={})[0] is not (
        SegmentKind.SCHEDULE_DAYS
    ):
        day += 1
    return day


@pytest.mark.timeout(180)
def test_kill_9_while_moving_a_day_into_hours_stores_each_message_once_in_due_order(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "d"
    count = 40_000
    tiers = Tiers(load_ahead_us=300_000_000)
    day = day_bucket_ahead(time.time_ns() // 1000, tiers)
    scheduling = child(data_dir, 0, "schedule", day, count, 2000)
    assert scheduling.communicate(timeout=120)[0].split() == ["scheduled"]
    source = segment_path(data_dir, SegmentKind.SCHEDULE_DAYS, day)
    assert source.exists()

    move_at_s = tiers.move_at_us(SegmentKind.SCHEDULE_DAYS, day) / 1e6
    moving = child(data_dir, move_at_s - time.time(), "run", count)
    assert moving.stdout is not None
    chunks = 0
    for line in moving.stdout:
        moved = int(line.split()[1]) if line.startswith("moved") else 0
        chunks += moved > 0
        if chunks == 2 and moved < count:  # the first chunk's copies are durable by now
            moving.kill()  # SIGKILL, mid-move
            break
    moving.wait(10)
    assert moving.returncode == -9
    assert source.exists(), "the kill came after the move finished"
    copied = list_segments(data_dir, SegmentKind.SCHEDULE)
    assert copied, "no hour segment written before the kill"

    day_after_s = (day + 1) * 24 * 3600
    delivering = child(data_dir, day_after_s - time.time(), "run", count)
    out, _ = delivering.communicate(timeout=120)
    assert delivering.returncode == 0
    assert out.split()[-1] == "done"
    assert not source.exists()
    assert all(list_segments(data_dir, kind) == [] for kind in COARSE_SCHEDULE_KINDS)
    stored = [
        record.id
        for path in list_segments(data_dir, SegmentKind.MESSAGES)
        for _, record in iter_message_records(path)
    ]
    assert stored == [f"m-{i}" for i in range(count)]  # once each, in due order
