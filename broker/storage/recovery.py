"""Recovery: bring a data directory to a consistent state and rebuild what lives in memory.

1. Torn tails are truncated at the last whole, CRC-valid record (only segments at or after
   the checkpoint can have one).
2. Subject indexes are loaded, trimmed of entries that point past valid data, and extended
   from the message log past the checkpoint.
3. The dedup table is rebuilt from index entries inside the dedup window (ids are hashed in
   the index, so the log is not re-read).
4. Group state is the checkpoint's plus a replay of the action log past it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import time
from pathlib import Path

import orjson

from broker.errors import CorruptRecord, StorageError
from broker.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_SUFFIX,
    ActionRecord,
    ActionType,
    MessageRecord,
    SegmentKind,
    id_hash,
    index_header,
    iter_frames,
    list_segments,
    read_segment_header,
    scan_frames,
    segment_number,
)
from broker.groups import DeliveryState, Group
from broker.storage.checkpoint import Checkpoint
from broker.subjects import SubjectLog

logger = logging.getLogger(__name__)
FORMAT_FILE = "FORMAT"
_MSG_SEQ = struct.Struct("<BBQ")


@dataclasses.dataclass(slots=True)
class Recovered:
    subjects: dict[str, SubjectLog]
    groups: dict[tuple[str, str], Group]
    messages_at: tuple[int, int]
    actions_at: tuple[int, int]
    oldest_segment: int
    problems: list[str]
    seconds: float = 0.0


def check_format(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / FORMAT_FILE
    if path.exists():
        version = orjson.loads(path.read_bytes()).get("format")
        if version != FORMAT_VERSION:
            raise StorageError(
                f"{data_dir} holds format {version}; this broker reads {FORMAT_VERSION}"
            )
    else:
        path.write_bytes(orjson.dumps({"format": FORMAT_VERSION}))


def recover(data_dir: Path, *, dedup_window_s: float, now_us: int | None = None) -> Recovered:
    began = time.perf_counter()
    check_format(data_dir)
    now_us = now_us if now_us is not None else time.time_ns() // 1000
    checkpoint = Checkpoint.load(data_dir)
    problems: list[str] = []

    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    valid_ends = _repair_tails(segments, checkpoint.messages_at, SegmentKind.MESSAGES, problems)
    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    oldest = segment_number(segments[0]) if segments else 0
    subjects = _load_indexes(data_dir, segments, valid_ends, problems)
    scan_from = max(checkpoint.messages_at, (oldest, HEADER_SIZE))
    _index_tail(segments, scan_from, valid_ends, subjects)
    _save_indexes(data_dir, subjects)
    for subject in subjects.values():
        _finish_subject(subject, oldest_segment=oldest, now_us=now_us, window_s=dedup_window_s)

    action_segments = list_segments(data_dir, SegmentKind.ACTIONS)
    action_ends = _repair_tails(
        action_segments, checkpoint.actions_at, SegmentKind.ACTIONS, problems
    )
    action_segments = list_segments(data_dir, SegmentKind.ACTIONS)
    groups = _restore_groups(checkpoint)
    _replay_actions(action_segments, checkpoint.actions_at, groups)

    recovered = Recovered(
        subjects=subjects,
        groups=groups,
        messages_at=_end_position(segments, valid_ends),
        actions_at=_end_position(action_segments, action_ends),
        oldest_segment=oldest,
        problems=problems,
        seconds=time.perf_counter() - began,
    )
    for problem in problems:
        logger.warning(problem, extra={"action": "broker.recovery_problem"})
    return recovered


def _repair_tails(
    segments: list[Path], checkpointed: tuple[int, int], kind: SegmentKind, problems: list[str]
) -> dict[int, int]:
    """Truncate torn tails past the checkpoint; return each scanned segment's valid end.

    Records before the checkpoint position were fsynced and indexed, so they are trusted
    here; damage to them is caught by the CRC when they are read and never served.
    """
    ends: dict[int, int] = {}
    for index, path in enumerate(segments):
        number = segment_number(path)
        if number < checkpointed[0]:
            continue
        data = path.read_bytes()
        last = index == len(segments) - 1
        if len(data) < HEADER_SIZE and last:
            problems.append(f"{path}: header cut short; segment emptied")
            path.unlink()
            continue
        if read_segment_header(data, path=str(path)) is not kind:
            raise StorageError(f"{path} is not a {kind.name} segment")
        start = checkpointed[1] if number == checkpointed[0] else HEADER_SIZE
        scan = scan_frames(data, start=min(start, len(data)))
        if scan.problem is not None:
            if not last:
                raise CorruptRecord(path=str(path), offset=scan.valid_end, reason=scan.problem)
            problems.append(
                f"{path}: {scan.problem}; truncated {scan.file_size - scan.valid_end} bytes"
            )
            with open(path, "r+b") as handle:
                handle.truncate(scan.valid_end)
                os.fsync(handle.fileno())
        ends[number] = scan.valid_end
    return ends


def _load_indexes(
    data_dir: Path, segments: list[Path], valid_ends: dict[int, int], problems: list[str]
) -> dict[str, SubjectLog]:
    last_segment = segment_number(segments[-1]) if segments else -1
    subjects: dict[str, SubjectLog] = {}
    folder = data_dir / "index"
    if not folder.is_dir():
        return subjects
    for path in sorted(folder.glob(f"*{INDEX_SUFFIX}")):
        name = path.name[: -len(INDEX_SUFFIX)]
        data = path.read_bytes()
        if len(data) < INDEX_HEADER.size or data[:8] != INDEX_MAGIC:
            problems.append(f"{path}: unreadable header; rebuilt from the log")
            entries = bytearray()
        else:
            count = (len(data) - INDEX_HEADER.size) // INDEX_ENTRY_SIZE
            entries = bytearray(
                data[INDEX_HEADER.size : INDEX_HEADER.size + count * INDEX_ENTRY_SIZE]
            )
        while entries:
            segment, length, offset, _, _ = INDEX_ENTRY.unpack_from(
                entries, len(entries) - INDEX_ENTRY_SIZE
            )
            end = valid_ends.get(segment)
            if segment <= last_segment and (end is None or offset + length <= end):
                break
            del entries[-INDEX_ENTRY_SIZE:]
        subjects[name] = SubjectLog(name, entries)
    return subjects


def _index_tail(
    segments: list[Path],
    scan_from: tuple[int, int],
    valid_ends: dict[int, int],
    subjects: dict[str, SubjectLog],
) -> None:
    """Add index entries for records past the checkpoint that the index files lack."""
    for path in segments:
        number = segment_number(path)
        if number < scan_from[0]:
            continue
        data = path.read_bytes()[: valid_ends.get(number)]
        start = scan_from[1] if number == scan_from[0] else HEADER_SIZE
        for offset, payload in iter_frames(data, path=str(path), start=start):
            record = MessageRecord.decode(payload, path=str(path), offset=offset)
            subject = subjects.get(record.subject)
            if subject is None:
                subject = subjects[record.subject] = SubjectLog(record.subject)
            if record.seq < subject.next_seq:
                continue
            if record.seq > subject.next_seq:
                raise StorageError(
                    f"{path} at {offset}: {record.subject} seq {record.seq} follows "
                    f"{subject.next_seq - 1}; the index lost entries before the checkpoint"
                )
            subject.allocate(
                INDEX_ENTRY.pack(
                    number, len(payload) + 8, offset, record.stored_at_us, id_hash(record.id)
                )
            )


def _save_indexes(data_dir: Path, subjects: dict[str, SubjectLog]) -> None:
    folder = data_dir / "index"
    folder.mkdir(parents=True, exist_ok=True)
    for subject in subjects.values():
        path = folder / f"{subject.name}{INDEX_SUFFIX}"
        wanted = INDEX_HEADER.size + len(subject.entries)
        current = path.stat().st_size if path.exists() else -1
        if current == wanted:
            continue
        with open(path, "wb") as handle:
            handle.write(index_header())
            handle.write(subject.entries)
            handle.flush()
            os.fsync(handle.fileno())


def _finish_subject(
    subject: SubjectLog, *, oldest_segment: int, now_us: int, window_s: float
) -> None:
    count = subject.next_seq
    low, high = 0, count
    while low < high:  # first seq whose segment still exists
        mid = (low + high) // 2
        if subject.raw(mid)[0] < oldest_segment:
            low = mid + 1
        else:
            high = mid
    subject.first_seq = low
    subject.end_seq = count
    horizon = now_us - int(window_s * 1_000_000)
    view = memoryview(subject.entries)[low * INDEX_ENTRY_SIZE :]
    dedup = subject.dedup
    total = 0
    for seq, (_, length, _, stored, hashed) in enumerate(INDEX_ENTRY.iter_unpack(view), start=low):
        total += length
        if stored >= horizon:
            dedup[hashed] = seq
    subject.bytes_total = total


def _restore_groups(checkpoint: Checkpoint) -> dict[tuple[str, str], Group]:
    groups: dict[tuple[str, str], Group] = {}
    for subject, by_name in checkpoint.groups.items():
        for name, doc in by_name.items():
            groups[(subject, name)] = Group.restore(subject, name, doc)
    return groups


def apply_action(groups: dict[tuple[str, str], Group], record: ActionRecord) -> None:
    """Apply one action record to the group states (shared by replay and live operation)."""
    key = (record.subject, record.group)
    group = groups.get(key)
    if record.type is ActionType.GROUP:
        if group is None:
            group = groups[key] = Group(
                subject=record.subject, name=record.group, mode=str(record.fields["mode"])
            )
        if record.state not in group.states:
            group.states[record.state] = DeliveryState(int(record.fields["cursor"]))
        return
    if group is None:
        return
    state = group.states.get(record.state)
    if state is not None:
        state.apply(record)


def _replay_actions(
    segments: list[Path], start: tuple[int, int], groups: dict[tuple[str, str], Group]
) -> None:
    for path in segments:
        number = segment_number(path)
        if number < start[0]:
            continue
        data = path.read_bytes()
        offset = start[1] if number == start[0] else HEADER_SIZE
        for at, payload in iter_frames(data, path=str(path), start=offset):
            apply_action(groups, ActionRecord.decode(payload, path=str(path), offset=at))


def _end_position(segments: list[Path], ends: dict[int, int]) -> tuple[int, int]:
    if not segments:
        return (0, HEADER_SIZE)
    last = segment_number(segments[-1])
    if last not in ends:  # emptied above
        return (last, HEADER_SIZE)
    return (last, ends[last])
