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
from broker.groups import GroupTable
from broker.storage.checkpoint import Checkpoint
from broker.storage.fsync import rewrite_file, truncate_file
from broker.subjects import SubjectTable

logger = logging.getLogger(__name__)
FORMAT_FILE = "FORMAT"


@dataclasses.dataclass(slots=True)
class Recovered:
    subjects: SubjectTable
    groups: GroupTable
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
    entries = _load_indexes(data_dir, segments, valid_ends, problems)
    scan_from = max(checkpoint.messages_at, (oldest, HEADER_SIZE))
    _index_tail(segments, scan_from, valid_ends, entries)
    _save_indexes(data_dir, entries)
    subjects = SubjectTable.recovered(
        entries,
        oldest_segment=oldest,
        dedup_horizon_us=now_us - int(dedup_window_s * 1_000_000),
    )

    action_segments = list_segments(data_dir, SegmentKind.ACTIONS)
    action_ends = _repair_tails(
        action_segments, checkpoint.actions_at, SegmentKind.ACTIONS, problems
    )
    action_segments = list_segments(data_dir, SegmentKind.ACTIONS)
    groups = GroupTable.restore(checkpoint.groups)
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
            truncate_file(path, scan.valid_end)
        ends[number] = scan.valid_end
    return ends


def _load_indexes(
    data_dir: Path, segments: list[Path], valid_ends: dict[int, int], problems: list[str]
) -> dict[str, bytearray]:
    """Each subject's packed index entries, trimmed of entries past valid data."""
    last_segment = segment_number(segments[-1]) if segments else -1
    subjects: dict[str, bytearray] = {}
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
        subjects[name] = entries
    return subjects


def _index_tail(
    segments: list[Path],
    scan_from: tuple[int, int],
    valid_ends: dict[int, int],
    subjects: dict[str, bytearray],
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
            entries = subjects.setdefault(record.subject, bytearray())
            next_seq = len(entries) // INDEX_ENTRY_SIZE
            if record.seq < next_seq:
                continue
            if record.seq > next_seq:
                raise StorageError(
                    f"{path} at {offset}: {record.subject} seq {record.seq} follows "
                    f"{next_seq - 1}; the index lost entries before the checkpoint"
                )
            entries += INDEX_ENTRY.pack(
                number, len(payload) + 8, offset, record.stored_at_us, id_hash(record.id)
            )


def _save_indexes(data_dir: Path, subjects: dict[str, bytearray]) -> None:
    folder = data_dir / "index"
    folder.mkdir(parents=True, exist_ok=True)
    for name, entries in subjects.items():
        path = folder / f"{name}{INDEX_SUFFIX}"
        wanted = INDEX_HEADER.size + len(entries)
        current = path.stat().st_size if path.exists() else -1
        if current == wanted:
            continue
        rewrite_file(path, index_header(), entries)


def _replay_actions(segments: list[Path], start: tuple[int, int], groups: GroupTable) -> None:
    for path in segments:
        number = segment_number(path)
        if number < start[0]:
            continue
        data = path.read_bytes()
        offset = start[1] if number == start[0] else HEADER_SIZE
        for at, payload in iter_frames(data, path=str(path), start=offset):
            groups.apply(ActionRecord.decode(payload, path=str(path), offset=at))


def _end_position(segments: list[Path], ends: dict[int, int]) -> tuple[int, int]:
    if not segments:
        return (0, HEADER_SIZE)
    last = segment_number(segments[-1])
    if last not in ends:  # emptied above
        return (last, HEADER_SIZE)
    return (last, ends[last])
