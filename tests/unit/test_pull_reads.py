"""The read side of a pull: runs of adjacent frames in one pread, failures kept per record,
the same for a pull answered in JSON and one answered with records."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from qmq_broker.format import HEADER_SIZE, MessageRecord, SegmentKind
from qmq_broker.format.files import segment_header
from qmq_broker.format.frames import frame
from qmq_broker.pulls.reads import Batch, Served, read_ahead, read_batches, read_cached
from qmq_broker.storage.segments import NotCached, SegmentReader, segment_path
from qmq_wire.records import read_records_answer, records_answer
from tests.unit.page_cache import evicted_and_missed


@pytest.fixture(params=[False, True], ids=["json", "records"])
def records(request: pytest.FixtureRequest) -> bool:
    """The answer form the batches ask for: every test reads both."""
    return bool(request.param)


def shown(messages: list[Served]) -> list[dict[str, Any]]:
    """``seq`` and ``id`` of each served message, whichever form it was served in."""
    if not messages or isinstance(messages[0], dict):
        return [{"seq": m["seq"], "id": m["id"]} for m in messages]  # type: ignore[index]
    _, entries = read_records_answer(records_answer(b"{}", messages), orjson.loads)  # type: ignore[arg-type]
    return [{"seq": fields[0], "id": fields[6]} for _, _, fields in entries]


def record(seq: int) -> MessageRecord:
    return MessageRecord(
        seq=seq,
        id=f"id-{seq}",
        subject="orders",
        key=None,
        headers={},
        body=f"body-{seq}".encode(),
        body_base64=False,
        producer=None,
        created_at_us=1_700_000_000_000_000,
        stored_at_us=1_700_000_000_000_000,
        deliver_at_us=0,
    )


@pytest.fixture
def stored(tmp_path: Path) -> tuple[SegmentReader, list[tuple[int, int, int]]]:
    """Segment 0 holding seqs 0..5 back to back; returns (reader, positions by seq)."""
    path = segment_path(tmp_path, SegmentKind.MESSAGES, 0)
    path.parent.mkdir(parents=True)
    data = bytearray(segment_header(SegmentKind.MESSAGES))
    positions = []
    for seq in range(6):
        framed = frame(record(seq).encode())
        positions.append((0, len(data), len(framed)))
        data += framed
    assert positions[0][1] == HEADER_SIZE
    path.write_bytes(bytes(data))
    return SegmentReader(tmp_path, SegmentKind.MESSAGES), positions


def batch(
    positions: list[tuple[int, int, int]], seqs: list[int], records: bool, subject: str = "orders"
) -> Batch:
    return Batch(
        subject=subject,
        seqs=seqs,
        attempts=[1] * len(seqs),
        positions=[positions[s] for s in seqs],
        now_us=0,
        records=records,
    )


def test_adjacent_and_scattered_records_are_read_in_order(
    stored: tuple[SegmentReader, list[tuple[int, int, int]]],
    records: bool,
) -> None:
    reader, positions = stored
    [(messages, unreadable)], _ = read_batches(
        reader, [(batch(positions, [0, 1, 2, 4, 5], records), 0.0)]
    )
    assert [m["id"] for m in shown(messages)] == ["id-0", "id-1", "id-2", "id-4", "id-5"]
    assert unreadable == []


def test_a_corrupt_frame_inside_a_run_fails_alone(
    stored: tuple[SegmentReader, list[tuple[int, int, int]]], records: bool, tmp_path: Path
) -> None:
    reader, positions = stored
    path = segment_path(tmp_path, SegmentKind.MESSAGES, 0)
    data = bytearray(path.read_bytes())
    _, offset, length = positions[2]
    data[offset + length - 1] ^= 0xFF  # last body byte of seq 2: CRC mismatch
    path.write_bytes(bytes(data))
    [(messages, unreadable)], _ = read_batches(
        reader, [(batch(positions, [1, 2, 3], records), 0.0)]
    )
    assert [m["seq"] for m in shown(messages)] == [1, 3]
    assert [(seq, "CRC mismatch" in error) for seq, error in unreadable] == [(2, True)]


def test_a_missing_segment_makes_its_records_unreadable(
    stored: tuple[SegmentReader, list[tuple[int, int, int]]],
    records: bool,
) -> None:
    reader, positions = stored
    gone = [(7, offset, length) for _, offset, length in positions]  # segment 7 never existed
    [(messages, unreadable)], _ = read_batches(reader, [(batch(gone, [0, 1], records), 0.0)])
    assert messages == []
    assert [seq for seq, _ in unreadable] == [0, 1]


def test_a_frame_past_the_end_of_the_segment_is_unreadable(
    stored: tuple[SegmentReader, list[tuple[int, int, int]]],
    records: bool,
) -> None:
    reader, positions = stored
    _, offset, length = positions[5]
    beyond = [*positions, (0, offset + length, length), (0, offset + 2 * length, length)]
    [(messages, unreadable)], _ = read_batches(reader, [(batch(beyond, [5, 6, 7], records), 0.0)])
    assert [m["seq"] for m in shown(messages)] == [5]
    assert [seq for seq, _ in unreadable] == [6, 7]


def test_an_index_entry_pointing_at_another_record_never_serves_it(
    stored: tuple[SegmentReader, list[tuple[int, int, int]]],
    records: bool,
) -> None:
    reader, positions = stored
    crossed = [positions[0], positions[3], positions[2]]  # seq 1 points at seq 3's frame
    [(messages, unreadable)], _ = read_batches(reader, [(batch(crossed, [0, 1, 2], records), 0.0)])
    assert [m["seq"] for m in shown(messages)] == [0, 2]
    assert [seq for seq, _ in unreadable] == [1]
    assert "points at orders seq 3" in unreadable[0][1]
    [(messages, unreadable)], _ = read_batches(
        reader, [(batch(positions, [0], records, "payments"), 0.0)]
    )
    assert messages == []
    assert [seq for seq, _ in unreadable] == [0]


def test_a_cached_read_gives_up_on_what_is_only_on_disk(
    stored: tuple[SegmentReader, list[tuple[int, int, int]]], records: bool, tmp_path: Path
) -> None:
    """``read_cached`` serves what is in the page cache and raises ``NotCached`` for the
    rest, which ``read_batches`` (a read thread) reads from the disk."""
    reader, positions = stored
    wanted = [batch(positions, [0, 1, 2], records)]
    path = segment_path(tmp_path, SegmentKind.MESSAGES, 0)
    evicted_and_missed(path, lambda: read_cached(reader, wanted), NotCached)
    [(from_disk, _)], _ = read_batches(reader, [(batch(positions, [0, 1, 2], records), 0.0)])
    [(from_cache, unreadable)] = read_cached(reader, [batch(positions, [0, 1, 2], records)])
    assert from_cache == from_disk
    assert [m["seq"] for m in shown(from_cache)] == [0, 1, 2]
    assert unreadable == []


def test_reading_ahead_brings_what_is_on_disk_into_the_page_cache(
    stored: tuple[SegmentReader, list[tuple[int, int, int]]], records: bool, tmp_path: Path
) -> None:
    """``read_ahead`` returns at once; the kernel reads in the background, and a cached
    read then serves what was only on disk."""
    reader, positions = stored
    wanted = [batch(positions, [0, 1, 2], records)]
    path = segment_path(tmp_path, SegmentKind.MESSAGES, 0)
    evicted_and_missed(path, lambda: read_cached(reader, wanted), NotCached)
    read_ahead(reader, wanted)
    deadline = time.monotonic() + 5
    while True:
        try:
            [(messages, unreadable)] = read_cached(reader, wanted)
            break
        except NotCached:
            assert time.monotonic() < deadline, "read-ahead records never reached the cache"
            time.sleep(0.001)
    assert [m["seq"] for m in shown(messages)] == [0, 1, 2]
    assert unreadable == []
