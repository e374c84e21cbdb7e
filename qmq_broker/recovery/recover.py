"""Recovery: bring a data directory to a consistent state and rebuild what lives in memory.

1. Logs past the checkpoint are walked frame by frame, resynchronising past bad bytes
   (``qmq_broker.format.walk_frames``). Bad bytes with no valid frame after them, at the end of
   the last segment, are a torn tail and are truncated. Bad bytes followed by valid frames
   (or in a segment that is not the last) are corruption: they stay where they are, every
   valid frame after them is kept, and the problem is logged.
2. Subject indexes are loaded and extended from the message log past the checkpoint. A seq
   is never handed out again once any durable evidence shows it: an index entry, the
   checkpoint, a group's cursor, lease or ack, a later record. Its record may be gone (a
   segment cut below what the index holds) or sit in corrupt bytes: then its entry reads
   as unreadable, pulls dead-letter it (``unreadable record``) and serve the rest, and a
   record that is gone is counted and reported with its seqs (``Recovered.lost``). Bytes
   past every indexed record (a torn tail, never acknowledged) are cut without a count.
3. Each subject's dedup store (``qmq_broker.dedup``) is opened from its files, and the ids of
   the index entries its runs do not cover yet (the last few thousand) are added to it:
   ids are hashed in the index, so the log is not re-read.
4. Group state is the checkpoint's plus a replay of the action log past it; corrupt action
   records are skipped (a lost ack means a redelivery, never a loss).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import orjson

from qmq_broker.dedup import DedupStore
from qmq_broker.errors import CorruptRecord, StorageError
from qmq_broker.format.actions import ActionRecord, is_action_record
from qmq_broker.format.files import (
    FORMAT_FILE,
    FORMAT_VERSION,
    HEADER_SIZE,
    SegmentKind,
    list_segments,
    read_format,
    read_segment_header,
    segment_number,
)
from qmq_broker.format.frames import FRAME_SIZE, BadRegion, walk_frames
from qmq_broker.format.ids import id_hash
from qmq_broker.format.index import INDEX_CHUNK_ENTRIES, INDEX_ENTRY, INDEX_ENTRY_SIZE, chunk_start
from qmq_broker.format.messages import is_message_record, peek_message
from qmq_broker.groups import GroupTable
from qmq_broker.recovery.gone import (
    Gone,
    keep_checkpointed_seqs,
    keep_seqs_groups_saw,
    mark,
    mark_records_gone,
    still_gone,
)
from qmq_broker.recovery.index import WorkingIndex, load_indexes
from qmq_broker.recovery.index_repair import rebuild_chunk
from qmq_broker.recovery.migrate import migrate
from qmq_broker.recovery.ranges import seq_ranges
from qmq_broker.storage.checkpoint import Checkpoint, IndexDigest
from qmq_broker.storage.fsync import truncate_file
from qmq_broker.storage.index_files import ChunkReader, remove_chunk
from qmq_broker.storage.segments import segment_path
from qmq_broker.subjects import RecoveredSubject, SubjectTable, window_start

logger = logging.getLogger(__name__)
DEDUP_FLUSH_AT = INDEX_CHUNK_ENTRIES  # ids a subject's dedup store holds in a dict at most


@dataclasses.dataclass(slots=True)
class Recovered:
    subjects: SubjectTable
    groups: GroupTable
    messages_at: tuple[int, int]
    actions_at: tuple[int, int]
    oldest_segment: int
    problems: list[str]
    seconds: float = 0.0
    lost: dict[str, int] = dataclasses.field(default_factory=dict)  # per subject: records gone


def check_format(data_dir: Path) -> list[str]:
    """Make ``data_dir`` a data directory of the current format (migrating an older one);
    returns what a migration did."""
    data_dir.mkdir(parents=True, exist_ok=True)
    version = read_format(data_dir)
    if version is None:
        (data_dir / FORMAT_FILE).write_bytes(orjson.dumps({"format": FORMAT_VERSION}))
        return []
    if version == FORMAT_VERSION:
        return []
    if version < FORMAT_VERSION:
        return migrate(data_dir, version)
    raise StorageError(f"{data_dir} holds format {version}; this broker reads {FORMAT_VERSION}")


def recover(
    data_dir: Path,
    *,
    dedup_window_s: float,
    now_us: int | None = None,
    on_damage: str = "fail",
    dedup_flush_at: int = DEDUP_FLUSH_AT,
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
    newest = segment_number(segments[-1]) if segments else 0
    scan_from = max(messages_from, (oldest, HEADER_SIZE))
    loaded = load_indexes(
        data_dir, checkpoint.indexes, hold_from_segment=scan_from[0], problems=problems
    )
    indexes, rebuild = loaded.indexes, loaded.rebuild
    gone = mark_records_gone(indexes, segments, valid_ends)
    if rebuild:
        scan_from = (oldest, HEADER_SIZE)
    _index_tail(segments, scan_from, valid_ends, indexes, rebuild, gone, problems, data_dir)
    keep_checkpointed_seqs(indexes, checkpoint.indexes, newest, rebuild, gone)
    keep_seqs_groups_saw(indexes, groups, newest, gone, data_dir)
    lost = _report_lost(indexes, gone, problems)
    for subject, _ in groups:  # a subject its groups pulled from before anything was stored
        indexes.setdefault(subject, WorkingIndex(data_dir=data_dir, name=subject))
    for index in indexes.values():
        index.save()
    reader = ChunkReader(data_dir, repair=functools.partial(rebuild_chunk, data_dir))
    subjects = SubjectTable.recovered(
        reader,
        [
            _recovered_subject(
                index,
                checkpoint.indexes.get(name),
                oldest_segment=oldest,
                dedup_horizon_us=now_us - int(dedup_window_s * 1_000_000),
                dedup_dir=data_dir / "dedup",
                dedup_flush_at=dedup_flush_at,
                problems=problems,
            )
            for name, index in indexes.items()
        ],
        dedup_dir=data_dir / "dedup",
        dedup_flush_at=dedup_flush_at,
    )

    recovered = Recovered(
        subjects=subjects,
        groups=groups,
        messages_at=_end_position(segments, valid_ends),
        actions_at=_end_position(action_segments, action_ends),
        oldest_segment=oldest,
        problems=problems,
        seconds=time.perf_counter() - began,
        lost=lost,
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
        raise StorageError(
            f"{what}; restore them, or start serving around them: "
            f"qmq broker --data-dir {where.parent} --on-damage skip"
        )
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
            raise StorageError(
                f"{exc}; restore it from a backup, or start with --on-damage skip (its frames "
                f"are read past the header): qmq broker --data-dir {path.parent.parent} "
                "--on-damage skip"
            ) from exc
        problems.append(f"{exc}; skipped: its frames are read as {kind.name.lower()} records")


def _cost(kind: SegmentKind) -> str:
    if kind is SegmentKind.MESSAGES:
        return "the messages in them are unreadable (dead-lettered when pulled); kept the rest"
    return "the group changes in them are lost (their messages may be delivered again)"


def _report_lost(
    indexes: dict[str, WorkingIndex], gone: Gone, problems: list[str]
) -> dict[str, int]:
    """Count and report the seqs still marked as gone (a record found in the log replaced
    its mark): one problem and one error line per subject, with the seq ranges."""
    lost: dict[str, int] = {}
    for name, seqs in sorted(gone.items()):
        index = indexes[name]
        still = still_gone(index, seqs)
        if not still:
            continue
        lost[name] = len(still)
        ranges = seq_ranges(still)
        problems.append(
            f"{name}: {len(still)} stored messages lost, seqs {ranges}: their records are "
            "gone from the log; the seqs stay allocated and are dead-lettered as unreadable "
            "record when pulled"
        )
        logger.error(
            "stored messages lost",
            extra={
                "action": "broker.messages_lost",
                "subject": name,
                "count": len(still),
                "seqs": ranges,
            },
        )
    return lost


def _index_tail(
    segments: list[Path],
    scan_from: tuple[int, int],
    valid_ends: dict[int, int],
    indexes: dict[str, WorkingIndex],
    rebuild: set[str],
    gone: Gone,
    problems: list[str],
    data_dir: Path,
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
            seq, stored_at_us, name, message_id = peek_message(payload)
            index = indexes.get(name)
            if index is None:
                index = indexes[name] = WorkingIndex(data_dir=data_dir, name=name)
            entries = index.entries
            next_seq = index.count
            entry = INDEX_ENTRY.pack(
                number, len(payload) + 8, offset, stored_at_us, id_hash(message_id)
            )
            if seq < next_seq:
                if seq < index.base and name not in rebuild:
                    continue  # in a sealed chunk: its CRC vouched for it
                if index.set(seq, entry) and seq not in gone.get(name, ()):
                    problems.append(f"index of {name}: seq {seq} corrected from the log")
                continue
            if seq > next_seq:
                gap = seq - next_seq
                if name in rebuild and next_seq == 0 and oldest > 0:
                    entries += INDEX_ENTRY.pack(oldest - 1, FRAME_SIZE, 0, 0, 0) * gap
                elif damaged is not None:
                    segment, region = damaged
                    length = region.end - region.start
                    entries += INDEX_ENTRY.pack(segment, length, region.start, 0, 0) * gap
                elif name in rebuild:  # records gone with no trace but their seqs
                    gone.setdefault(name, set()).update(range(next_seq, seq))
                    entries += mark(number) * gap
                else:
                    raise StorageError(
                        f"{path} at {offset}: {name} seq {seq} follows {next_seq - 1}; the "
                        "index lost entries before the checkpoint; rebuild it from the log: "
                        f"qmq broker verify --data-dir {data_dir} --repair"
                    )
            entries += entry


def _recovered_subject(
    index: WorkingIndex,
    digest: IndexDigest | None,
    *,
    oldest_segment: int,
    dedup_horizon_us: int,
    dedup_dir: Path,
    dedup_flush_at: int,
    problems: list[str],
) -> RecoveredSubject:
    """A subject's counters from its index, reading only what the checkpoint does not
    vouch for; chunks that retention emptied are deleted."""
    count = index.count
    first_seq = index.first_seq_where(index.first_chunk, lambda entry: entry[0] >= oldest_segment)
    stored = -1
    if (
        digest is not None
        and not index.rebuilt
        and 0 <= digest.first_seq <= first_seq
        and digest.bytes >= 0
        and digest.count <= count
    ):
        try:
            stored = (
                digest.bytes
                - index.lengths(digest.first_seq, first_seq)
                + index.lengths(digest.count, count)
            )
        except FileNotFoundError:  # retention removed chunks the checkpoint still counted
            stored = -1
    if stored < 0:
        stored = index.lengths(first_seq, count)
    for start in range(index.first_chunk, chunk_start(first_seq), INDEX_CHUNK_ENTRIES):
        remove_chunk(index.data_dir, index.name, start)
    horizon = index.first_seq_where(first_seq, lambda entry: entry[3] >= dedup_horizon_us)
    dedup = DedupStore.open(
        dedup_dir / index.name, flush_at=dedup_flush_at, horizon=window_start(first_seq, horizon)
    )
    problems += (f"{dedup.directory}: {problem}" for problem in dedup.problems)
    for seq, entry in index.entries_between(max(dedup.covered_end, horizon), count):
        dedup.add(entry[4], seq)
    open_start = chunk_start(count)
    at = (open_start - index.base) * INDEX_ENTRY_SIZE
    return RecoveredSubject(
        name=index.name,
        open_start=open_start,
        open_entries=bytearray(index.entries[at:]),
        first_seq=first_seq,
        bytes=stored,
        dedup=dedup,
    )


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
