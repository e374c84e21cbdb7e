"""Rewrite a data directory's derived files (indexes, checkpoints, route tables) from its logs.

Never writes a segment. Each subject's index is rebuilt from the message log and its chunks
rewritten only when they differ; seqs are never given back: a seq whose record is gone points at its
segment's header, as recovery marks it, so it reads as unreadable. A checkpoint that does
not check out is removed and, when recovery would leave every segment as it is (no torn
tail or bad header in the message or action log), written anew from a recovery run.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections import defaultdict
from pathlib import Path

from qmq_broker.dedup.filter import FILTER_FILE
from qmq_broker.dedup.runs import parse_run_name
from qmq_broker.errors import StorageError
from qmq_broker.format.files import (
    KIND_DIRS,
    SegmentKind,
    list_segments,
    segment_number,
)
from qmq_broker.format.frames import FRAME_SIZE
from qmq_broker.format.ids import id_hash
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY,
    IndexEntry,
    chunk_start,
    index_chunk_path,
    list_index_chunks,
    list_indexed_subjects,
)
from qmq_broker.format.messages import MessageRecord
from qmq_broker.ordered.offline import repair_route_files
from qmq_broker.recovery.recover import recover
from qmq_broker.recovery.verify import Report, check_data_dir
from qmq_broker.recovery.verify_log import read_index
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE, Checkpoint
from qmq_broker.storage.index_files import CHUNK_BYTES, read_chunk, write_chunk
from qmq_broker.storage.lock import DataDirLock
from qmq_broker.storage.segments import message_frames

CHECKPOINTS = (CHECKPOINT_FILE, PREVIOUS_FILE)
LOGS = (KIND_DIRS[SegmentKind.MESSAGES], KIND_DIRS[SegmentKind.ACTIONS])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Repaired:
    """What ``repair`` rewrote or removed, one line each."""

    done: tuple[str, ...]


def repair(data_dir: Path, report: Report) -> Repaired:
    """Rebuild the derived files ``report`` found damaged (and any index that differs);
    ``DataDirLocked`` while another process holds ``data_dir``."""
    check_data_dir(data_dir)
    with DataDirLock(data_dir):
        return _repair(data_dir, report)


def _repair(data_dir: Path, report: Report) -> Repaired:
    done: list[str] = []
    bad_checkpoints = [
        f.path
        for f in report.findings
        if f.derived and f.path.parent == data_dir and f.path.name in CHECKPOINTS
    ]  # not a route table of a subject named "checkpoint"
    for path in bad_checkpoints:
        path.unlink()
        done.append(f"removed {path} (did not check out)")
    done += rebuild_indexes(data_dir)
    done += repair_route_files(data_dir)
    done += _drop_damaged_dedup_files(
        [f.path for f in report.findings if f.path.parent.parent.name == "dedup"]
    )
    if bad_checkpoints:
        done.append(_checkpoint_anew(data_dir, report))
    return Repaired(done=tuple(done))


def _drop_damaged_dedup_files(damaged: list[Path]) -> list[str]:
    """A damaged run goes with every newer run of its store (so the runs left end where the
    damage began, and the broker adds those ids again from the index when it opens the
    store); a damaged filter goes (the broker rebuilds it from the runs)."""
    done = []
    for path in sorted(set(damaged)):
        if not path.exists():
            continue  # went with an older damaged run
        if path.suffix != ".run":
            path.unlink()
            done.append(f"removed {path} (rebuilt from the runs on start)")
            continue
        first = parse_run_name(path.name)
        for run in sorted(path.parent.glob("*.run")):
            found = parse_run_name(run.name)
            if first is not None and found is not None and found[0] >= first[0]:
                run.unlink()
                done.append(f"removed {run} (its ids are added again from the index on start)")
        (path.parent / FILTER_FILE).unlink(missing_ok=True)
    return done


def rebuild_indexes(data_dir: Path) -> list[str]:
    """Rewrite each subject's index chunks that differ from what the message log holds."""
    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    oldest = segment_number(segments[0]) if segments else 0
    found = _entries_in_log(segments)
    subjects = set(found) | set(list_indexed_subjects(data_dir))
    done = []
    for subject in sorted(subjects):
        old = read_index(data_dir, subject)
        chunks = list_index_chunks(data_dir, subject)
        in_log = found.get(subject, {})
        start = min([*chunks[:1], chunk_start(min(in_log))] if in_log else chunks[:1], default=0)
        entries = _rebuilt(in_log, old, oldest, start)
        for first in range(start, start + len(entries) // INDEX_ENTRY.size, INDEX_CHUNK_ENTRIES):
            at = (first - start) * INDEX_ENTRY.size
            wanted = entries[at : at + INDEX_CHUNK_ENTRIES * INDEX_ENTRY.size]
            path = index_chunk_path(data_dir, subject, first)
            current = read_chunk(path) if path.exists() else None
            sealed = len(wanted) < CHUNK_BYTES or (
                current is not None and current.sealed_crc == zlib.crc32(wanted)
            )
            if current is not None and current.entries == wanted and sealed:
                continue
            write_chunk(data_dir, subject, first, wanted)
            done.append(f"rewrote {path} ({len(wanted) // INDEX_ENTRY.size} entries)")
    return done


def _entries_in_log(segments: list[Path]) -> dict[str, dict[int, bytes]]:
    """``{subject: {seq: packed index entry}}`` for every readable message record."""
    found: dict[str, dict[int, bytes]] = defaultdict(dict)
    for path in segments:
        number = segment_number(path)
        for offset, payload in message_frames(path):
            record = MessageRecord.decode(payload, path=str(path), offset=offset)
            found[record.subject][record.seq] = INDEX_ENTRY.pack(
                number, FRAME_SIZE + len(payload), offset, record.stored_at_us, id_hash(record.id)
            )
    return found


def _rebuilt(
    found: dict[int, bytes], old: dict[int, IndexEntry], oldest: int, start: int
) -> bytearray:
    """A subject's entries from seq ``start``: from the log where it holds the record; else
    the old entry when it cannot be checked (retention removed its segment) or is already
    marked unreadable; else a mark pointing at the header of the segment before it (seqs
    stay allocated)."""
    count = max(max(old, default=-1) + 1, max(found, default=-1) + 1)
    out = bytearray()
    segment, stored = max(oldest - 1, 0), 0  # before any record: removed by retention
    for seq in range(start, count):
        packed = found.get(seq)
        entry = old.get(seq)
        if packed is None and entry is not None and _unverifiable_or_marked(entry, oldest):
            packed = entry.encode()
        if packed is None:
            packed = INDEX_ENTRY.pack(segment, FRAME_SIZE, 0, stored, 0)
        segment, _, _, stored, _ = INDEX_ENTRY.unpack(packed)
        out += packed
    return out


def _unverifiable_or_marked(entry: IndexEntry, oldest: int) -> bool:
    return entry.segment < oldest or (entry.offset == 0 and entry.length == FRAME_SIZE)


def _checkpoint_anew(data_dir: Path, report: Report) -> str:
    touched = [f.path for f in report.findings if not f.derived and f.path.parent.name in LOGS]
    if touched:  # recovery may cut a torn tail there: leave that to the broker
        return (
            f"no new checkpoint written: recovery would change {touched[0]}; the broker "
            "writes one after its next start"
        )
    try:
        recovered = recover(data_dir, dedup_window_s=0.0)
    except StorageError as exc:
        return f"no new checkpoint written: recovery failed ({exc})"
    Checkpoint(
        messages_at=recovered.messages_at,
        actions_at=recovered.actions_at,
        groups=recovered.groups.snapshot(),
        written_at_us=time.time_ns() // 1000,
    ).write(data_dir)
    return f"wrote {data_dir / CHECKPOINT_FILE} from a recovery of the logs"
