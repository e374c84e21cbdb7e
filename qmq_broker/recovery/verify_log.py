"""The offline check of the message log against its index: index chunks, message
segments, and index entries whose record is wrong or gone (``qmq_broker.recovery.verify``
runs it with the other checks)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from pathlib import Path

from qmq_broker.format.files import (
    KIND_DIRS,
    SegmentKind,
    list_segments,
    segment_name,
    segment_number,
)
from qmq_broker.format.frames import FRAME_SIZE, BadRegion, walk_frames
from qmq_broker.format.ids import id_hash
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    IndexEntry,
    entry_offset,
    index_chunk_path,
    list_index_chunks,
    list_indexed_subjects,
)
from qmq_broker.format.messages import MessageRecord, is_message_record
from qmq_broker.recovery.findings import COSTS, Finding, derived, header_finding
from qmq_broker.recovery.ranges import seq_ranges
from qmq_broker.storage.index_files import read_chunk


@dataclasses.dataclass(frozen=True, slots=True)
class Indexed:
    """One index entry with the subject and seq it belongs to."""

    subject: str
    seq: int
    entry: IndexEntry
    path: Path

    @property
    def marked_unreadable(self) -> bool:
        """Recovery points a seq whose record is gone at the segment header on purpose."""
        return self.entry.offset == 0 and self.entry.length == FRAME_SIZE


# --- indexes -----------------------------------------------------------------------------


def index_chunks(data_dir: Path) -> list[tuple[str, int, Path]]:
    """Every index chunk file: (subject, first seq, path)."""
    return [
        (subject, start, index_chunk_path(data_dir, subject, start))
        for subject in list_indexed_subjects(data_dir)
        for start in list_index_chunks(data_dir, subject)
    ]


def read_index(data_dir: Path, subject: str) -> dict[int, IndexEntry]:
    """A subject's readable index entries by seq (chunks with a bad header left out)."""
    entries: dict[int, IndexEntry] = {}
    for start in list_index_chunks(data_dir, subject):
        found = read_chunk(index_chunk_path(data_dir, subject, start))
        if found is not None:
            for at in range(0, len(found.entries), INDEX_ENTRY_SIZE):
                entries[start + at // INDEX_ENTRY_SIZE] = IndexEntry.decode(found.entries, at)
    return entries


def read_indexes(data_dir: Path) -> tuple[list[Indexed], list[Finding]]:
    indexed: list[Indexed] = []
    findings: list[Finding] = []
    previous: tuple[str, int] | None = None
    for subject, start, path in index_chunks(data_dir):
        if previous is not None and previous[0] == subject and previous[1] != start:
            findings.append(
                derived(
                    path,
                    0,
                    f"index chunk(s) of seqs {previous[1]}..{start - 1} missing",
                    f"seqs {previous[1]}..{start - 1} of {subject}",
                )
            )
        previous = (subject, start + INDEX_CHUNK_ENTRIES)
        found = read_chunk(path)
        if found is None:
            findings.append(derived(path, 0, "index header unreadable", "every seq of it"))
            continue
        if not found.seal_matches():
            findings.append(
                derived(path, 0, "index chunk does not match the CRC it was sealed with", "")
            )
        loose = (path.stat().st_size - INDEX_HEADER.size) % INDEX_ENTRY_SIZE
        if loose:
            at = INDEX_HEADER.size + len(found.entries)
            findings.append(derived(path, at, f"{loose} bytes past the last whole entry", ""))
        indexed += (
            Indexed(
                subject, start + at // INDEX_ENTRY_SIZE, IndexEntry.decode(found.entries, at), path
            )
            for at in range(0, len(found.entries), INDEX_ENTRY_SIZE)
        )
    return indexed, findings


def unindexed_subjects(data_dir: Path, in_log: set[str], indexed: set[str]) -> list[Finding]:
    return [
        derived(
            data_dir / "index" / subject,
            0,
            "index missing for a subject in the message log",
            f"every seq of {subject}",
        )
        for subject in sorted(in_log - indexed)
    ]


# --- message segments ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Framed:
    length: int
    record: MessageRecord


class Present:
    """Which (subject, seq) the message log holds a valid record of: a bitmap per subject."""

    def __init__(self) -> None:
        self._bits: dict[str, bytearray] = {}

    def add(self, subject: str, seq: int) -> None:
        bits = self._bits.setdefault(subject, bytearray())
        if len(bits) <= seq >> 3:
            bits.extend(bytes((seq >> 3) + 1 - len(bits)))
        bits[seq >> 3] |= 1 << (seq & 7)

    def holds(self, subject: str, seq: int) -> bool:
        bits = self._bits.get(subject)
        return bits is not None and len(bits) > seq >> 3 and bool(bits[seq >> 3] >> (seq & 7) & 1)


def check_message_segment(
    path: Path, entries: list[Indexed], present: Present
) -> tuple[list[Finding], set[str], list[tuple[Indexed, str]]]:
    """Damage in a message segment, the subjects it holds, and the index entries pointing
    into it that match no frame there (whether their record is gone is known only once
    every segment was read: ``present`` collects the records found)."""
    data = path.read_bytes()
    header = header_finding(path, data, SegmentKind.MESSAGES)
    findings = [] if header is None else [header]
    frames: dict[int, _Framed] = {}
    regions: list[BadRegion] = []
    for item in walk_frames(data, check=is_message_record):
        if isinstance(item, BadRegion):
            regions.append(item)
        else:
            offset, payload = item
            record = MessageRecord.decode(payload, path=str(path), offset=offset)
            frames[offset] = _Framed(FRAME_SIZE + len(payload), record)
            present.add(record.subject, record.seq)
    for region in regions:
        inside = [
            e
            for e in entries
            if region.start <= e.entry.offset < region.end and not e.marked_unreadable
        ]
        if inside:
            lost, cost = len(inside), _region_cost(f"{len(inside)} messages unreadable")
        elif region.torn and _is_newest(path):
            lost, cost = 0, "no stored message in it: a torn tail, cut at the broker's next start"
        else:
            lost, cost = 0, _region_cost("no indexed message in it")
        findings.append(
            Finding(
                path=path, offset=region.start, damage=region.reason, cost=cost, unreadable=lost
            )
        )
    wrong: list[tuple[Indexed, str]] = []
    for indexed in entries:
        at = indexed.entry.offset
        if indexed.marked_unreadable or any(r.start <= at < r.end for r in regions):
            continue
        why = _mismatch(indexed, frames.get(at))
        if why:
            wrong.append((indexed, why))
    return findings, {framed.record.subject for framed in frames.values()}, wrong


def _is_newest(path: Path) -> bool:
    return path == list_segments(path.parent.parent, SegmentKind.MESSAGES)[-1]


def unmatched_entries(
    unmatched: list[tuple[Path, Indexed, str]], present: Present
) -> list[Finding]:
    """Index entries that match no frame: a wrong entry when the log holds the record
    elsewhere (derived: the broker corrects it, ``--repair`` rebuilds it), else a message
    whose record is gone (the segment was cut, replaced or removed): unreadable, counted."""
    findings = []
    gone: dict[Path, list[Indexed]] = defaultdict(list)
    for segment, indexed, why in unmatched:
        seq = indexed.seq
        if present.holds(indexed.subject, seq):
            damage = f"entry for seq {seq} does not match the log ({why})"
            findings.append(derived(indexed.path, entry_offset(indexed.seq), damage, f"seq {seq}"))
        else:
            gone[segment].append(indexed)
    for segment, items in gone.items():
        seqs = defaultdict(list)
        for item in items:
            seqs[item.subject].append(item.seq)
        which = "; ".join(f"{subject} seqs {seq_ranges(sorted(s))}" for subject, s in seqs.items())
        damage = f"{len(items)} stored records are gone from it ({which})"
        cost = (
            f"{len(items)} messages unreadable: the broker keeps their seqs, reports them "
            "when it starts and dead-letters them when pulled"
        )
        at = min(item.entry.offset for item in items)
        findings.append(
            Finding(path=segment, offset=at, damage=damage, cost=cost, unreadable=len(items))
        )
    return findings


def _region_cost(lost: str) -> str:
    return f"{lost} (dead-lettered when pulled); the rest of the segment is kept"


def _mismatch(item: Indexed, framed: _Framed | None) -> str:
    entry = item.entry
    if framed is None:
        return f"no frame starts at offset {entry.offset}"
    record = framed.record
    checks = [
        (entry.length == framed.length, f"length {entry.length}, the frame has {framed.length}"),
        (record.seq == item.seq, f"the frame holds seq {record.seq}"),
        (record.subject == item.subject, f"the frame holds subject {record.subject}"),
        (entry.id_hash == id_hash(record.id), "id hash differs"),
        (entry.stored_at_us == record.stored_at_us, "stored time differs"),
    ]
    return "; ".join(why for ok, why in checks if not ok)


def missing_segments(
    data_dir: Path, kind: SegmentKind, by_segment: dict[int, list[Indexed]]
) -> list[Finding]:
    """Numbers missing between two existing segments (retention removes only the oldest)."""
    numbers = [segment_number(path) for path in list_segments(data_dir, kind)]
    findings = []
    for low, high in itertools.pairwise(numbers):
        for number in range(low + 1, high):
            if kind is SegmentKind.MESSAGES:  # its entries are counted by ``unmatched_entries``
                lost = "the messages in it are unreadable"
            else:
                lost = COSTS[kind]
            cost = (
                f"{lost}; the broker starts only with --on-damage skip "
                f"(qmq broker --data-dir {data_dir} --on-damage skip)"
            )
            path = data_dir / KIND_DIRS[kind] / segment_name(number)
            findings.append(Finding(path=path, offset=0, damage="segment missing", cost=cost))
    return findings


def beyond_the_log(
    data_dir: Path, messages: list[Path], by_segment: dict[int, list[Indexed]]
) -> list[tuple[Path, Indexed, str]]:
    """Index entries pointing at a message segment that is missing: past the newest, or
    between two others (retention removes only the oldest)."""
    numbers = {segment_number(path) for path in messages}
    oldest = min(numbers, default=0)
    newest = max(numbers, default=-1)
    return [
        (data_dir / KIND_DIRS[SegmentKind.MESSAGES] / segment_name(number), item, "missing")
        for number, items in sorted(by_segment.items())
        if number not in numbers and (number > newest or number > oldest)
        for item in items
        if not item.marked_unreadable
    ]
