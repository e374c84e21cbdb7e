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

Each schedule segment's tally (``qmq_broker.format.schedule.BucketTally``) says how long it
was and how many records it held: a segment that ends before its tally says was cut, and
the records it no longer holds, less those its dispatch segment lists, are counted lost
(``Unreadable`` with ``cut``), as is every record of a tally whose segment is gone. Under
``write`` each tally is then set to what the segment holds.

Damage never stops the broker but for a header that is not the directory's kind: that fails
recovery, naming the file and the way out, unless ``on_damage`` is ``"skip"``; then the
header is read past (every frame keeps its own CRC). Records in damaged bytes are listed in
``unreadable`` (``qmq_broker.delayed.damage``). ``write=False`` changes nothing on disk, for
``verify``, which so counts exactly what a start would.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import time
from array import array
from pathlib import Path

from qmq_broker.delayed.damage import (
    Done,
    Unreadable,
    header_damage,
    moved_or_dispatched,
    record_bounds,
    unreadable_records,
)
from qmq_broker.delayed.idset import HashSet64
from qmq_broker.delayed.scan import FrameWalk, dispatched_offsets, mapped
from qmq_broker.errors import StorageError
from qmq_broker.format.files import (
    HEADER_SIZE,
    KIND_DIRS,
    SegmentKind,
    list_segments,
    segment_number,
)
from qmq_broker.format.frames import FRAME_SIZE
from qmq_broker.format.schedule import (
    COARSE_SCHEDULE_KINDS,
    BucketTally,
    DispatchRecord,
    ScheduleRecord,
    hour_bucket,
    is_dispatch_record,
    is_schedule_record,
    read_tallies,
    schedule_bucket,
)
from qmq_broker.storage.buckets import BucketKey, tallies_path
from qmq_broker.storage.fsync import replace_file, truncate_file
from qmq_broker.storage.segments import segment_path

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
    # schedule segments -> records they hold (whole or damaged), where their tallies start
    records: dict[BucketKey, int] = dataclasses.field(default_factory=dict)
    tallies: dict[BucketKey, BucketTally] = dataclasses.field(default_factory=dict)  # found
    gone: set[BucketKey] = dataclasses.field(default_factory=set)  # deleted here, counted
    # coarse buckets on disk -> offsets of their records already moved into finer buckets
    coarse: dict[BucketKey, set[int]] = dataclasses.field(default_factory=dict)
    unreadable: list[Unreadable] = dataclasses.field(default_factory=list)
    headers: list[tuple[Path, str]] = dataclasses.field(default_factory=list)  # read past
    torn: list[tuple[Path, int, int]] = dataclasses.field(default_factory=list)  # start, size
    # damaged bytes holding only records already dispatched or moved: nothing lost
    harmless: list[tuple[Path, int, int]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Policy:
    on_damage: str
    write: bool


def recover_schedule(
    data_dir: Path, *, on_damage: str = "fail", write: bool = True
) -> ScheduleRecovered:
    """Scan every bucket segment; ``StorageError`` for a bad header unless ``on_damage`` is
    ``"skip"``. With ``write=False`` nothing on disk changes (``verify``)."""
    began = time.perf_counter()
    policy = _Policy(on_damage=on_damage, write=write)
    if write:
        for kind in (SegmentKind.SCHEDULE, SegmentKind.DISPATCH):
            (data_dir / KIND_DIRS[kind]).mkdir(parents=True, exist_ok=True)
    recovered = ScheduleRecovered(buckets={}, subjects={}, ids=HashSet64(), ends={}, problems=[])
    ends, problems = recovered.ends, recovered.problems
    recovered.tallies = read_tallies(tallies_path(data_dir), problems)
    schedule = {segment_number(p): p for p in list_segments(data_dir, SegmentKind.SCHEDULE)}
    dispatched: dict[int, set[int]] = {}
    for path in list_segments(data_dir, SegmentKind.DISPATCH):
        number = segment_number(path)
        if number not in schedule:
            dispatched[number] = dispatched_offsets(data_dir, number)  # for a tally left
            problems.append(f"{path}: no schedule segment of that hour; deleted")
            if write:
                path.unlink()
            continue
        scanned = _scan_dispatch(path, recovered, policy)
        if scanned is not None:
            ends[(SegmentKind.DISPATCH, number)], dispatched[number] = scanned
    keys: array[int] = array("Q")
    for number, path in sorted(schedule.items()):
        done = dispatched.get(number, set())
        end = _scan_bucket(path, SegmentKind.SCHEDULE, number, done, recovered, keys, policy)
        if end is not None:
            ends[(SegmentKind.SCHEDULE, number)] = end
    recovered.ids.add_many(keys)
    for kind in COARSE_SCHEDULE_KINDS:  # finest first: a moved copy is found before its source
        keys = array("Q")
        for path in list_segments(data_dir, kind):
            number = segment_number(path)
            end = _scan_bucket(path, kind, number, set(), recovered, keys, policy)
            if end is not None:
                ends[(kind, number)] = end
        recovered.ids.add_many(keys)
    _orphan_tallies(data_dir, dispatched, recovered)
    if write:
        _rewrite_tallies(data_dir, recovered)
    recovered.seconds = time.perf_counter() - began
    if write:
        _log(recovered)
    return recovered


def _log(recovered: ScheduleRecovered) -> None:
    lines = {lost.line() for lost in recovered.unreadable}
    for problem in recovered.problems:
        if problem not in lines:  # those are logged below, with their position
            logger.warning(problem, extra={"action": "broker.schedule_recovery_problem"})
    for lost in recovered.unreadable:
        logger.error(
            lost.line(),
            extra={
                "action": "broker.schedule_unreadable",
                "path": str(lost.path),
                "start": lost.start,
                "end": lost.end,
                "subject": lost.subject,
                "id": lost.message_id,
            },
        )


def _scan_dispatch(
    path: Path, into: ScheduleRecovered, policy: _Policy
) -> tuple[int, set[int]] | None:
    """Valid end and listed offsets of a dispatch segment (its torn tail cut)."""
    if _too_short(path, into.problems, policy) or not _header_ok(
        path, SegmentKind.DISPATCH, into, policy
    ):
        return None
    offsets: set[int] = set()
    with mapped(path) as buf:
        walk = FrameWalk(buf, check=is_dispatch_record)
        for at, body, length in walk:
            record = DispatchRecord.decode(buf[body : body + length], path=str(path), offset=at)
            offsets.update(record.offsets)
        _note_damage(buf, path, SegmentKind.DISPATCH, walk, into, lambda at, _: False)
    _cut(path, walk, into, policy)
    return walk.valid_end, offsets


def _scan_bucket(
    path: Path,
    kind: SegmentKind,
    bucket: int,
    done: set[int],
    into: ScheduleRecovered,
    keys: array[int],
    policy: _Policy,
) -> int | None:
    """Count a bucket segment's pending records (its torn tail cut); its valid end.

    An hour's records at the offsets in ``done`` went out (its dispatch segment lists them);
    the others count under that hour. A coarse bucket's record whose key is already pending
    was moved into a finer bucket: its offset is noted, not counted; the others count under
    their due hour.
    """
    if not _readable(path, kind, bucket, len(done), into, policy):
        return None
    hourly = kind is SegmentKind.SCHEDULE
    moved = None if hourly else into.coarse.setdefault((kind, bucket), set())
    unit = "hour" if hourly else "bucket"
    name = str(path)
    held = 0
    with mapped(path) as buf:
        walk = FrameWalk(buf, check=is_schedule_record)
        for offset, body, length in walk:
            held += 1
            if offset in done:
                continue
            deliver, key = ScheduleRecord.peek(buf, body, path=name, offset=offset)
            if moved is not None and key in into.ids:
                moved.add(offset)
                continue
            if schedule_bucket(kind, deliver) != bucket:
                into.problems.append(f"{path} at {offset}: due time outside the {unit}; kept")
            subject = ScheduleRecord.peek_subject(buf, body, path=name, offset=offset)
            hour = bucket if hourly else hour_bucket(deliver)
            _count(into, hour, subject, deliver, FRAME_SIZE + length)
            keys.append(key)
        pending = _no if hourly else into.ids.__contains__
        _note_damage(buf, path, kind, walk, into, moved_or_dispatched(done, pending))
        held += _damaged_records(buf, walk)
    _cut(path, walk, into, policy)
    gone_out = sum(1 for offset in done if offset >= walk.valid_end)
    _settle_tally(path, kind, bucket, walk.valid_end, held, gone_out, into)
    return walk.valid_end


def _no(key: int) -> bool:
    return False


def _readable(
    path: Path, kind: SegmentKind, bucket: int, done: int, into: ScheduleRecovered, policy: _Policy
) -> bool:
    """Whether to walk a schedule segment: not when its header was cut short (deleted, and
    its tally's records but ``done`` dispatched counted lost)."""
    if _too_short(path, into.problems, policy):
        _settle_tally(path, kind, bucket, 0, 0, done, into)
        return False
    return _header_ok(path, kind, into, policy)


def _count(into: ScheduleRecovered, hour: int, subject: str, deliver: int, size: int) -> None:
    into.buckets.setdefault(hour, BucketCounts()).add(deliver, size)
    per_subject = into.subjects.get(subject)
    if per_subject is None:
        per_subject = into.subjects[subject] = [0, 0]
    per_subject[0] += 1
    per_subject[1] += size


HARMLESS = "only records already dispatched or moved into a finer bucket: nothing lost"


def _too_short(path: Path, problems: list[str], policy: _Policy) -> bool:
    if path.stat().st_size >= HEADER_SIZE:
        return False
    problems.append(f"{path}: header cut short (an empty file a crash left); deleted")
    if policy.write:
        path.unlink()
    return True


def _header_ok(path: Path, kind: SegmentKind, into: ScheduleRecovered, policy: _Policy) -> bool:
    """Whether to read the segment: its header is ``kind``'s, or is read past under ``skip``."""
    with open(path, "rb") as handle:
        damage = header_damage(handle.read(HEADER_SIZE), kind, path=path)
    if damage is None:
        return True
    what = f"{path}: {damage}; it holds {_holds(kind)} of every subject"
    if policy.on_damage != "skip":
        raise StorageError(
            f"{what}; start with --on-damage skip to read its records past the header (each "
            f"keeps its own CRC); qmq broker verify --data-dir {path.parent.parent} says what "
            "else is damaged"
        )
    into.headers.append((path, damage))
    into.problems.append(f"{what}; read past it (--on-damage skip)")
    return True


def _holds(kind: SegmentKind) -> str:
    if kind is SegmentKind.DISPATCH:
        return "the record of which delayed messages of its hour went out"
    return "delayed messages"


def _note_damage(
    buf: bytes | mmap.mmap,
    path: Path,
    kind: SegmentKind,
    walk: FrameWalk,
    into: ScheduleRecovered,
    done: Done,
) -> None:
    for start, end in walk.skipped:
        found = unreadable_records(buf, path=path, kind=kind, start=start, end=end, done=done)
        into.unreadable += found
        into.problems += (lost.line() for lost in found)
        if not found:
            into.harmless.append((path, start, end))
            into.problems.append(f"{path}: corrupt bytes [{start}, {end}); {HARMLESS}")


def _cut(path: Path, walk: FrameWalk, into: ScheduleRecovered, policy: _Policy) -> None:
    """Truncate a torn tail (a write a crash cut short) at the last whole record."""
    if walk.problem is None:
        return
    size = path.stat().st_size
    into.torn.append((path, walk.valid_end, size))
    into.problems.append(f"{path}: {walk.problem}; truncated {size - walk.valid_end} bytes")
    if policy.write:
        truncate_file(path, walk.valid_end)


def _damaged_records(buf: bytes | mmap.mmap, walk: FrameWalk) -> int:
    """Records in the corrupt bytes a walk went past (each region at least one)."""
    return sum(len(record_bounds(buf, start, end)) for start, end in walk.skipped)


def _settle_tally(
    path: Path,
    kind: SegmentKind,
    bucket: int,
    valid_end: int,
    held: int,
    gone_out: int,
    into: ScheduleRecovered,
) -> None:
    """Count what a cut took: the tally's records past what the segment still holds, less
    ``gone_out`` it listed as dispatched. ``valid_end`` 0: the segment is deleted (its
    header was cut short). Afterwards ``into.records`` holds what the segment holds."""
    tally = into.tallies.get((kind, bucket))
    if tally is not None and tally.end > valid_end:
        lost = tally.records - held - gone_out
        into.torn = [torn for torn in into.torn if torn[0] != path]  # acknowledged, not torn
        if lost > 0:
            _count_cut(path, kind, valid_end, tally.end, lost, into)
    if valid_end:
        into.records[(kind, bucket)] = held
    else:
        into.gone.add((kind, bucket))


def _count_cut(
    path: Path, kind: SegmentKind, start: int, end: int, lost: int, into: ScheduleRecovered
) -> None:
    found = Unreadable(path=path, kind=kind, start=start, end=end, records=lost, cut=True)
    into.unreadable.append(found)
    into.problems.append(found.line())


def _orphan_tallies(
    data_dir: Path, dispatched: dict[int, set[int]], into: ScheduleRecovered
) -> None:
    """A tally whose segment is gone (deleted by hand, say): its records are lost, but for
    those its hour's dispatch segment listed."""
    for key, tally in into.tallies.items():
        kind, bucket = key
        if key in into.records or key in into.gone or segment_path(data_dir, kind, bucket).exists():
            continue  # scanned, or its header cut short (counted there)
        gone_out = len(dispatched.get(bucket, ())) if kind is SegmentKind.SCHEDULE else 0
        if tally.records > gone_out:
            path = segment_path(data_dir, kind, bucket)
            _count_cut(path, kind, 0, tally.end, tally.records - gone_out, into)


def _rewrite_tallies(data_dir: Path, into: ScheduleRecovered) -> None:
    """Set every tally to what its segment now holds (the writer's count starts there);
    the segments gone lose theirs."""
    settled = [
        BucketTally(kind=kind, bucket=bucket, end=into.ends[(kind, bucket)], records=held)
        for (kind, bucket), held in sorted(into.records.items())
    ]
    if {t.key: t for t in settled} != into.tallies:
        replace_file(tallies_path(data_dir), b"".join(t.encode() for t in settled))
