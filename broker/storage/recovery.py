"""Recovery: bring a data directory to a consistent state and rebuild what lives in memory.

1. Logs past the checkpoint are walked frame by frame, resynchronising past bad bytes
   (``broker.format.walk_frames``). Bad bytes with no valid frame after them, at the end of
   the last segment, are a torn tail and are truncated. Bad bytes followed by valid frames
   (or in a segment that is not the last) are corruption: they stay where they are, every
   valid frame after them is kept, and the problem is logged.
2. Subject indexes are loaded, trimmed of entries that point past valid data, and extended
   from the message log past the checkpoint. A seq whose record sits in corrupt bytes gets
   an index entry pointing at them: it reads as unreadable, so pulls dead-letter it
   (``unreadable record``) and serve the rest; seqs are not reused.
3. The dedup table is rebuilt from index entries inside the dedup window (ids are hashed in
   the index, so the log is not re-read).
4. Group state is the checkpoint's plus a replay of the action log past it; corrupt action
   records are skipped (a lost ack means a redelivery, never a loss).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from pathlib import Path

import orjson

from broker.errors import CorruptRecord, StorageError
from broker.format import (
    FORMAT_VERSION,
    FRAME_SIZE,
    HEADER_SIZE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_SUFFIX,
    ActionRecord,
    BadRegion,
    MessageRecord,
    SegmentKind,
    id_hash,
    index_header,
    is_action_record,
    is_message_record,
    list_segments,
    read_segment_header,
    segment_number,
    walk_frames,
)
from broker.groups import GroupTable
from broker.storage.checkpoint import Checkpoint
from broker.storage.fsync import rewrite_file, truncate_file
from broker.storage.segments import segment_path
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


def recover(
    data_dir: Path,
    *,
    dedup_window_s: float,
    now_us: int | None = None,
    on_damage: str = "fail",
) -> Recovered:
    """Bring ``data_dir`` to a consistent state and rebuild what lives in memory.

    Damage that cannot be made consistent (a segment missing between two others) raises
    ``StorageError`` naming it, unless ``on_damage`` is ``"skip"``: then it is served
    around (its messages read as unreadable, its group changes are lost) and noted.
    """
    began = time.perf_counter()
    check_format(data_dir)
    now_us = now_us if now_us is not None else time.time_ns() // 1000
    problems: list[str] = []
    checkpoint = Checkpoint.load(data_dir, problems)

    messages_from = _checked(data_dir, SegmentKind.MESSAGES, checkpoint.messages_at, problems)
    actions_from = _checked(data_dir, SegmentKind.ACTIONS, checkpoint.actions_at, problems)
    for kind in (SegmentKind.MESSAGES, SegmentKind.ACTIONS):
        _check_contiguous(list_segments(data_dir, kind), kind, on_damage, problems)
    action_segments = list_segments(data_dir, SegmentKind.ACTIONS)
    action_ends = _scan_logs(
        action_segments, actions_from, SegmentKind.ACTIONS, problems, on_damage=on_damage
    )
    action_segments = list_segments(data_dir, SegmentKind.ACTIONS)
    groups = GroupTable.restore(checkpoint.groups)
    _replay_actions(action_segments, actions_from, groups)

    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    valid_ends = _scan_logs(
        segments, messages_from, SegmentKind.MESSAGES, problems, on_damage=on_damage
    )
    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    oldest = segment_number(segments[0]) if segments else 0
    rewrite: set[str] = set()  # subjects whose index file must be written anew
    rebuild: set[str] = set()  # subjects whose index is rebuilt from the log
    entries = _load_indexes(data_dir, segments, valid_ends, checkpoint, problems, rewrite, rebuild)
    scan_from = (oldest, HEADER_SIZE) if rebuild else max(messages_from, (oldest, HEADER_SIZE))
    _index_tail(segments, scan_from, valid_ends, entries, rebuild, problems, rewrite)
    newest = segment_number(segments[-1]) if segments else 0
    _keep_checkpointed_seqs(entries, checkpoint.indexes, newest, rebuild)
    _keep_seqs_groups_saw(entries, groups, newest, problems, rewrite)
    _save_indexes(data_dir, entries, rewrite)
    for subject, _ in groups:  # a subject its groups pulled from before anything was stored
        entries.setdefault(subject, bytearray())
    subjects = SubjectTable.recovered(
        entries,
        oldest_segment=oldest,
        dedup_horizon_us=now_us - int(dedup_window_s * 1_000_000),
    )

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


def _checked(
    data_dir: Path, kind: SegmentKind, position: tuple[int, int], problems: list[str]
) -> tuple[int, int]:
    """Where to scan a log from: the checkpoint's position, or the start of its segment
    when the segment is now shorter than the checkpoint says (cut or restored from an older
    copy): never from a stale offset past the end."""
    segment, offset = position
    path = segment_path(data_dir, kind, segment)
    if path.exists() and path.stat().st_size < offset:
        problems.append(
            f"{path}: {path.stat().st_size} bytes, shorter than the checkpoint's {offset}; "
            "rescanned from the segment's start; what was past its end is unreadable"
        )
        return (segment, HEADER_SIZE)
    return position


def _check_contiguous(
    segments: list[Path], kind: SegmentKind, on_damage: str, problems: list[str]
) -> None:
    """Retention removes segments from the front only: a gap is damage."""
    numbers = [segment_number(path) for path in segments]
    missing = sorted(set(range(numbers[0], numbers[-1])) - set(numbers)) if numbers else []
    if not missing:
        return
    where = segments[0].parent
    what = f"{where}: segment(s) {', '.join(map(str, missing))} missing between others"
    if on_damage != "skip":
        raise StorageError(f"{what}; restore them, or start with --on-damage skip")
    problems.append(f"{what}; skipped: {_cost(kind)}")


_CHECKS = {SegmentKind.MESSAGES: is_message_record, SegmentKind.ACTIONS: is_action_record}


def _scan_logs(
    segments: list[Path],
    checkpointed: tuple[int, int],
    kind: SegmentKind,
    problems: list[str],
    *,
    on_damage: str = "fail",
) -> dict[int, int]:
    """Truncate torn tails past the checkpoint, note corruption; each scanned segment's end.

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
        _check_header(data, path, kind, on_damage, problems)
        start = min(checkpointed[1] if number == checkpointed[0] else HEADER_SIZE, len(data))
        end = start
        for item in walk_frames(data, start=start, check=_CHECKS[kind]):
            if not isinstance(item, BadRegion):
                end = item[0] + FRAME_SIZE + len(item[1])
            elif item.torn and last:
                problems.append(f"{path}: {item.reason}; truncated {len(data) - item.start} bytes")
                truncate_file(path, item.start)
            else:
                problems.append(f"{path}: {item.reason}; {_cost(kind)}")
                end = item.end
        ends[number] = end
    return ends


def _check_header(
    data: bytes, path: Path, kind: SegmentKind, on_damage: str, problems: list[str]
) -> None:
    """A segment header that is not ours fails recovery, or with ``skip`` is read past (its
    frames still carry their own CRCs)."""
    try:
        found = read_segment_header(data, path=str(path))
        if found is not kind:
            raise StorageError(f"{path} is not a {kind.name} segment")
    except (CorruptRecord, StorageError) as exc:
        if on_damage != "skip":
            raise StorageError(f"{exc}; fix or remove it, or start with --on-damage skip") from exc
        problems.append(f"{exc}; skipped: its frames are read as {kind.name.lower()} records")


def _cost(kind: SegmentKind) -> str:
    if kind is SegmentKind.MESSAGES:
        return "the messages in them are unreadable (dead-lettered when pulled); kept the rest"
    return "the group changes in them are lost (their messages may be delivered again)"


def _load_indexes(
    data_dir: Path,
    segments: list[Path],
    valid_ends: dict[int, int],
    checkpoint: Checkpoint,
    problems: list[str],
    rewrite: set[str],
    rebuild: set[str],
) -> dict[str, bytearray]:
    """Each subject's packed index entries, checked against the checkpoint and the log.

    An index whose first entries do not match the checkpoint's digest of them is damaged:
    it is emptied and its subject added to ``rebuild`` (the index is derived data).

    Entries past valid data and past the checkpoint are a torn batch (never acknowledged):
    they are trimmed. Entries past valid data but covered by the checkpoint were durable
    (their log was cut or replaced since): they keep their seqs, so no seq is reused, and
    point at the segment header, where no frame can ever be, so they read as unreadable.
    """
    checkpointed = checkpoint.messages_at
    last_segment = segment_number(segments[-1]) if segments else -1
    subjects: dict[str, bytearray] = {}
    folder = data_dir / "index"
    if not folder.is_dir():
        return subjects

    def gone(entries: bytearray, seq: int) -> tuple[bool, bool]:
        segment, length, offset, _, _ = INDEX_ENTRY.unpack_from(entries, seq * INDEX_ENTRY_SIZE)
        end = valid_ends.get(segment)
        lost = segment > last_segment or (end is not None and offset + length > end)
        return lost, (segment, offset + length) <= checkpointed

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
        if not _matches_digest(entries, checkpoint.indexes.get(name)):
            problems.append(f"{path}: does not match the checkpoint; rebuilt from the log")
            subjects[name] = bytearray()
            rebuild.add(name)
            continue
        keep = len(entries) // INDEX_ENTRY_SIZE
        while keep and gone(entries, keep - 1) == (True, False):
            keep -= 1
        del entries[keep * INDEX_ENTRY_SIZE :]
        seq = keep - 1
        while seq >= 0 and gone(entries, seq)[0]:
            segment, _, _, stored, _ = INDEX_ENTRY.unpack_from(entries, seq * INDEX_ENTRY_SIZE)
            INDEX_ENTRY.pack_into(
                entries, seq * INDEX_ENTRY_SIZE, segment, FRAME_SIZE, 0, stored, 0
            )
            seq -= 1
        if seq < keep - 1:
            rewrite.add(name)
            problems.append(
                f"{path}: seqs {seq + 1}..{keep - 1} were checkpointed but their "
                "records are gone; they stay allocated and read as unreadable"
            )
        subjects[name] = entries
    for name in checkpoint.indexes.keys() - subjects.keys():  # index file gone
        if checkpoint.indexes[name][0] > 0:
            problems.append(f"index of {name}: missing; rebuilt from the log")
            subjects[name] = bytearray()
            rebuild.add(name)
    rewrite |= rebuild
    return subjects


def _matches_digest(entries: bytearray, digest: tuple[int, int] | None) -> bool:
    """Whether the first entries are the ones the checkpoint covered (no digest: trusted)."""
    if digest is None:
        return True
    count, crc = digest
    covered = memoryview(entries)[: count * INDEX_ENTRY_SIZE]  # no copy of a large index
    matches = len(covered) == count * INDEX_ENTRY_SIZE and zlib.crc32(covered) == crc
    covered.release()
    return matches


def _keep_checkpointed_seqs(
    subjects: dict[str, bytearray],
    digests: dict[str, tuple[int, int]],
    segment: int,
    rebuild: set[str],
) -> None:
    """A rebuilt index keeps every seq the checkpoint covered, found in the log or not:
    those were acknowledged, so they are never handed out again (unreadable if gone)."""
    for name in rebuild:
        count = digests.get(name, (0, 0))[0]
        entries = subjects[name]
        have = len(entries) // INDEX_ENTRY_SIZE
        if have < count:
            entries += INDEX_ENTRY.pack(segment, FRAME_SIZE, 0, 0, 0) * (count - have)


def _index_tail(
    segments: list[Path],
    scan_from: tuple[int, int],
    valid_ends: dict[int, int],
    subjects: dict[str, bytearray],
    rebuild: set[str],
    problems: list[str],
    rewrite: set[str],
) -> None:
    """Add index entries for records past ``scan_from`` that the index files lack, and
    correct entries that disagree with the record they index.

    Seqs missing before a record get entries that read as unreadable, so they are never
    reused: pointing at the corrupt bytes they sat in, or, for a subject whose index is
    being rebuilt, at a segment before the oldest (removed by retention) or at a segment
    header (where no frame can be).
    """
    damaged: tuple[int, BadRegion] | None = None  # the latest corrupt region seen
    previous: int | None = None
    oldest = segment_number(segments[0]) if segments else 0
    for path in segments:
        number = segment_number(path)
        if previous is not None and number > previous + 1:  # skipped: a missing segment
            damaged = (previous + 1, BadRegion(0, FRAME_SIZE, torn=False))
        previous = number
        if number < scan_from[0]:
            continue
        data = path.read_bytes()[: valid_ends.get(number)]
        start = scan_from[1] if number == scan_from[0] else HEADER_SIZE
        for item in walk_frames(data, start=start, check=is_message_record):
            if isinstance(item, BadRegion):
                damaged = (number, item)
                continue
            offset, payload = item
            record = MessageRecord.decode(payload, path=str(path), offset=offset)
            name = record.subject
            entries = subjects.setdefault(name, bytearray())
            next_seq = len(entries) // INDEX_ENTRY_SIZE
            entry = INDEX_ENTRY.pack(
                number, len(payload) + 8, offset, record.stored_at_us, id_hash(record.id)
            )
            if record.seq < next_seq:
                at = record.seq * INDEX_ENTRY_SIZE
                if entries[at : at + INDEX_ENTRY_SIZE] != entry:
                    entries[at : at + INDEX_ENTRY_SIZE] = entry
                    rewrite.add(name)
                    problems.append(f"index of {name}: seq {record.seq} corrected from the log")
                continue
            if record.seq > next_seq:
                gap = record.seq - next_seq
                if name in rebuild and next_seq == 0 and oldest > 0:
                    entries += INDEX_ENTRY.pack(oldest - 1, FRAME_SIZE, 0, 0, 0) * gap
                elif damaged is not None:
                    segment, region = damaged
                    length = region.end - region.start
                    entries += INDEX_ENTRY.pack(segment, length, region.start, 0, 0) * gap
                elif name in rebuild:
                    entries += INDEX_ENTRY.pack(number, FRAME_SIZE, 0, 0, 0) * gap
                else:
                    raise StorageError(
                        f"{path} at {offset}: {name} seq {record.seq} follows "
                        f"{next_seq - 1}; the index lost entries before the checkpoint"
                    )
            entries += entry


def _keep_seqs_groups_saw(
    subjects: dict[str, bytearray],
    groups: GroupTable,
    segment: int,
    problems: list[str],
    rewrite: set[str],
) -> None:
    """Seqs a group already read must never be handed out again, even when the log lost them
    (a tail cut past the checkpoint): they stay allocated and read as unreadable (their
    entries point at a segment header, where no frame can be)."""
    seen: dict[str, int] = {}
    for (subject, _), group in groups.items():
        for state in group.states.values():
            top = max((state.cursor - 1, *state.leases, *state.retries, *state.dead))
            seen[subject] = max(seen.get(subject, -1), top)
    for subject, top in seen.items():
        entries = subjects.setdefault(subject, bytearray())
        count = len(entries) // INDEX_ENTRY_SIZE
        if top >= count:
            entries += INDEX_ENTRY.pack(segment, FRAME_SIZE, 0, 0, 0) * (top + 1 - count)
            rewrite.add(subject)
            problems.append(
                f"{subject}: seqs {count}..{top} were read by a group but are gone from the "
                "log; they stay allocated and read as unreadable"
            )


def _save_indexes(data_dir: Path, subjects: dict[str, bytearray], rewrite: set[str]) -> None:
    folder = data_dir / "index"
    folder.mkdir(parents=True, exist_ok=True)
    for name, entries in subjects.items():
        path = folder / f"{name}{INDEX_SUFFIX}"
        wanted = INDEX_HEADER.size + len(entries)
        current = path.stat().st_size if path.exists() else -1
        if current == wanted and name not in rewrite:
            continue
        rewrite_file(path, index_header(), entries)


def _replay_actions(segments: list[Path], start: tuple[int, int], groups: GroupTable) -> None:
    for path in segments:
        number = segment_number(path)
        if number < start[0]:
            continue
        data = path.read_bytes()
        offset = start[1] if number == start[0] else HEADER_SIZE
        for item in walk_frames(data, start=offset, check=is_action_record):
            if not isinstance(item, BadRegion):  # noted by _scan_logs
                at, payload = item
                groups.apply(ActionRecord.decode(payload, path=str(path), offset=at))


def _end_position(segments: list[Path], ends: dict[int, int]) -> tuple[int, int]:
    if not segments:
        return (0, HEADER_SIZE)
    last = segment_number(segments[-1])
    if last not in ends:  # emptied above
        return (last, HEADER_SIZE)
    return (last, ends[last])
