"""Startup scan of the schedule and dispatch logs (runs on a worker thread).

Every bucket segment may have been the last write to its file, so each one's torn tail is
truncated at its last whole record. Then every schedule record not listed in its hour's
dispatch segment is pending: its key goes into the scheduled-id set and its size into the
per-hour and per-subject counts. Dispatch segments without a schedule segment are left
over from a cleanup cut short and are deleted. Nothing is loaded into the wheel here: the
scheduler loads hours as they come near (and at once, those already due).

Coarse buckets (days, 32 days) are scanned after the hours, finest first. Their records
count under their due hour. A record whose (subject, id) key is already pending in a finer
bucket was copied there by a move that a crash cut short before the coarse segment was
deleted: it is not counted again, and its offset is noted so the move skips it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from array import array
from pathlib import Path

from qmq_broker.delayed.idset import HashSet64
from qmq_broker.delayed.scan import FrameWalk, mapped
from qmq_broker.format import (
    COARSE_SCHEDULE_KINDS,
    FRAME_SIZE,
    HEADER_SIZE,
    HOUR_US,
    KIND_DIRS,
    DispatchRecord,
    ScheduleRecord,
    SegmentKind,
    hour_bucket,
    is_dispatch_record,
    is_schedule_record,
    list_segments,
    schedule_bucket,
    segment_number,
)
from qmq_broker.storage.buckets import BucketKey
from qmq_broker.storage.fsync import truncate_file

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class BucketCounts:
    """Pending (not yet dispatched) records of one hour."""

    pending: int = 0
    bytes: int = 0
    min_due_us: int | None = None

    def add(self, deliver_at_us: int, size: int) -> None:
        self.pending += 1
        self.bytes += size
        if self.min_due_us is None or deliver_at_us < self.min_due_us:
            self.min_due_us = deliver_at_us


@dataclasses.dataclass(slots=True)
class ScheduleRecovered:
    buckets: dict[int, BucketCounts]
    subjects: dict[str, list[int]]  # subject -> [pending messages, bytes]
    ids: HashSet64
    ends: dict[BucketKey, int]
    problems: list[str]
    # coarse buckets on disk -> offsets of their records already moved into finer buckets
    coarse: dict[BucketKey, set[int]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def recover_schedule(data_dir: Path) -> ScheduleRecovered:
    began = time.perf_counter()
    for kind in (SegmentKind.SCHEDULE, SegmentKind.DISPATCH):
        (data_dir / KIND_DIRS[kind]).mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    ends: dict[BucketKey, int] = {}
    schedule = {segment_number(p): p for p in list_segments(data_dir, SegmentKind.SCHEDULE)}
    dispatched: dict[int, set[int]] = {}
    for path in list_segments(data_dir, SegmentKind.DISPATCH):
        number = segment_number(path)
        if number not in schedule:
            problems.append(f"{path}: no schedule segment of that hour; deleted")
            path.unlink()
            continue
        scanned = _scan_dispatch(path, problems)
        if scanned is not None:
            ends[(SegmentKind.DISPATCH, number)], dispatched[number] = scanned
    recovered = ScheduleRecovered(
        buckets={}, subjects={}, ids=HashSet64(), ends=ends, problems=problems
    )
    keys: array[int] = array("Q")
    for number, path in sorted(schedule.items()):
        end = _scan_schedule(path, number, dispatched.get(number, set()), recovered, keys)
        if end is not None:
            ends[(SegmentKind.SCHEDULE, number)] = end
    recovered.ids.add_many(keys)
    for kind in COARSE_SCHEDULE_KINDS:  # finest first: a moved copy is found before its source
        keys = array("Q")
        for path in list_segments(data_dir, kind):
            number = segment_number(path)
            end = _scan_coarse(path, kind, number, recovered, keys)
            if end is not None:
                ends[(kind, number)] = end
        recovered.ids.add_many(keys)
    recovered.seconds = time.perf_counter() - began
    for problem in problems:
        logger.warning(problem, extra={"action": "broker.schedule_recovery_problem"})
    return recovered


def _scan_dispatch(path: Path, problems: list[str]) -> tuple[int, set[int]] | None:
    """Valid end and listed offsets of a dispatch segment (its torn tail cut)."""
    if _too_short(path, problems):
        return None
    offsets: set[int] = set()
    with mapped(path, SegmentKind.DISPATCH) as buf:
        walk = FrameWalk(buf, check=is_dispatch_record)
        for at, body, length in walk:
            record = DispatchRecord.decode(buf[body : body + length], path=str(path), offset=at)
            offsets.update(record.offsets)
    _cut(path, walk, problems)
    return walk.valid_end, offsets


def _scan_schedule(
    path: Path, bucket: int, done: set[int], into: ScheduleRecovered, keys: array[int]
) -> int | None:
    """Count a schedule segment's pending records (its torn tail cut); its valid end."""
    if _too_short(path, problems=into.problems):
        return None
    counts = into.buckets.setdefault(bucket, BucketCounts())
    subjects = into.subjects
    name = str(path)
    with mapped(path, SegmentKind.SCHEDULE) as buf:
        walk = FrameWalk(buf, check=is_schedule_record)
        for offset, body, length in walk:
            if offset in done:
                continue
            deliver, key = ScheduleRecord.peek(buf, body, path=name, offset=offset)
            subject = ScheduleRecord.peek_subject(buf, body, path=name, offset=offset)
            if deliver // HOUR_US != bucket:
                into.problems.append(f"{path} at {offset}: due time outside the hour; kept")
            size = FRAME_SIZE + length
            counts.add(deliver, size)
            keys.append(key)
            per_subject = subjects.get(subject)
            if per_subject is None:
                per_subject = subjects[subject] = [0, 0]
            per_subject[0] += 1
            per_subject[1] += size
    _cut(path, walk, into.problems)
    return walk.valid_end


def _scan_coarse(
    path: Path, kind: SegmentKind, bucket: int, into: ScheduleRecovered, keys: array[int]
) -> int | None:
    """Count a coarse segment's records not yet moved (its torn tail cut); its valid end."""
    if _too_short(path, problems=into.problems):
        return None
    moved = into.coarse.setdefault((kind, bucket), set())
    name = str(path)
    with mapped(path, kind) as buf:
        walk = FrameWalk(buf, check=is_schedule_record)
        for offset, body, length in walk:
            deliver, key = ScheduleRecord.peek(buf, body, path=name, offset=offset)
            if key in into.ids:
                moved.add(offset)
                continue
            if schedule_bucket(kind, deliver) != bucket:
                into.problems.append(f"{path} at {offset}: due time outside the bucket; kept")
            subject = ScheduleRecord.peek_subject(buf, body, path=name, offset=offset)
            _count(into, hour_bucket(deliver), subject, deliver, FRAME_SIZE + length)
            keys.append(key)
    _cut(path, walk, into.problems)
    return walk.valid_end


def _count(into: ScheduleRecovered, hour: int, subject: str, deliver: int, size: int) -> None:
    into.buckets.setdefault(hour, BucketCounts()).add(deliver, size)
    per_subject = into.subjects.get(subject)
    if per_subject is None:
        per_subject = into.subjects[subject] = [0, 0]
    per_subject[0] += 1
    per_subject[1] += size


def _too_short(path: Path, problems: list[str]) -> bool:
    if path.stat().st_size >= HEADER_SIZE:
        return False
    problems.append(f"{path}: header cut short; deleted")
    path.unlink()
    return True


def _cut(path: Path, walk: FrameWalk, problems: list[str]) -> None:
    """Note corrupt bytes walked past; truncate a torn tail at the last whole record."""
    for start, end in walk.skipped:
        problems.append(
            f"{path}: corrupt bytes [{start}, {end}); the records in them are lost "
            "(a schedule record: that delayed message; a dispatch record: its messages are "
            "dispatched again and deduplicated by id); kept the rest"
        )
    if walk.problem is None:
        return
    size = path.stat().st_size
    problems.append(f"{path}: {walk.problem}; truncated {size - walk.valid_end} bytes")
    truncate_file(path, walk.valid_end)
