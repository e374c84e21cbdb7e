"""The schedule files' tallies: one checksummed slot per file, freed and reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from qmq_broker.delayed.recovery import recover_schedule
from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import SegmentKind, segment_name
from qmq_broker.format.schedule import TALLY_SIZE, BucketTally, read_tallies
from qmq_broker.storage.buckets import BucketFiles, BucketPlacer, tallies_path


def tally(bucket: int, end: int, records: int) -> BucketTally:
    return BucketTally(kind=SegmentKind.SCHEDULE, bucket=bucket, end=end, records=records)


def test_a_tally_reads_back_and_a_flipped_bit_is_refused() -> None:
    encoded = tally(7, 1_000, 3).encode()
    assert len(encoded) == TALLY_SIZE
    assert BucketTally.decode(encoded) == tally(7, 1_000, 3)
    assert BucketTally.decode(bytes(TALLY_SIZE)) is None  # a free slot
    damaged = bytearray(encoded)
    damaged[12] ^= 0x04
    with pytest.raises(CorruptRecord, match="CRC"):
        BucketTally.decode(bytes(damaged))


def test_the_placer_counts_schedule_records_only() -> None:
    placer = BucketPlacer({(SegmentKind.SCHEDULE, 5): 100}, {(SegmentKind.SCHEDULE, 5): 2})
    placer.place(SegmentKind.SCHEDULE, 5, 40)
    placer.place(SegmentKind.DISPATCH, 5, 30)
    assert placer.tally(SegmentKind.SCHEDULE, 5) == tally(5, 140, 3)
    assert placer.tally(SegmentKind.DISPATCH, 5) is None


def test_slots_are_written_in_place_freed_and_reused(tmp_path: Path) -> None:
    files = BucketFiles(tmp_path)
    files.write_tally(tally(1, 100, 1))
    files.write_tally(tally(2, 200, 2))
    files.write_tally(tally(1, 150, 2))  # the same slot again
    path = tallies_path(tmp_path)
    assert path.stat().st_size == 2 * TALLY_SIZE
    files.remove(SegmentKind.SCHEDULE, 1)
    assert set(read_tallies(path, [])) == {(SegmentKind.SCHEDULE, 2)}
    files.write_tally(tally(3, 300, 3))  # takes the freed slot
    assert path.stat().st_size == 2 * TALLY_SIZE
    files.close()

    reopened = BucketFiles(tmp_path)  # finds the slots by what they hold
    reopened.write_tally(tally(2, 250, 3))
    reopened.close()
    problems: list[str] = []
    assert read_tallies(path, problems) == {
        (SegmentKind.SCHEDULE, 2): tally(2, 250, 3),
        (SegmentKind.SCHEDULE, 3): tally(3, 300, 3),
    }
    assert problems == []
    assert path.stat().st_size == 2 * TALLY_SIZE


def test_a_damaged_slot_is_passed_over_and_named(tmp_path: Path) -> None:
    path = tallies_path(tmp_path)
    path.parent.mkdir(parents=True)
    damaged = bytearray(tally(1, 100, 1).encode())
    damaged[20] ^= 0x01
    path.write_bytes(bytes(damaged) + tally(2, 200, 2).encode())
    problems: list[str] = []
    assert read_tallies(path, problems) == {(SegmentKind.SCHEDULE, 2): tally(2, 200, 2)}
    assert len(problems) == 1
    assert "at 0" in problems[0]


@pytest.mark.parametrize("segment", [b"QMQ", None], ids=["header-cut-short", "file-gone"])
def test_a_lost_schedule_file_is_counted_once(tmp_path: Path, segment: bytes | None) -> None:
    """Its tally's records are counted at the first start, and the tally goes with the file,
    so the next start counts nothing."""
    path = tallies_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(tally(7, 900, 3).encode())
    if segment is not None:
        (path.parent / segment_name(7)).write_bytes(segment)
    first = recover_schedule(tmp_path)
    assert [(lost.records, lost.cut) for lost in first.unreadable] == [(3, True)]
    assert recover_schedule(tmp_path).unreadable == []
    assert read_tallies(path, []) == {}


def test_a_slot_written_before_a_restart_is_freed_with_its_segment(tmp_path: Path) -> None:
    """A segment written before a restart and deleted after it (dispatched, moved) takes its
    slot with it, though nothing wrote the tallies since the restart."""
    files = BucketFiles(tmp_path)
    files.write_tally(tally(1, 100, 1))
    files.write_tally(tally(2, 200, 2))
    files.close()
    restarted = BucketFiles(tmp_path)
    restarted.remove(SegmentKind.SCHEDULE, 1)
    restarted.close()
    assert set(read_tallies(tallies_path(tmp_path), [])) == {(SegmentKind.SCHEDULE, 2)}
