"""Offline check of a broker data directory (like ``fsck``): what is damaged, what it costs.

Reads every segment (message, action, schedule, dispatch), every index entry and both
checkpoints, opening each file read-only, and returns a ``Report`` of ``Finding``s. It
never writes; ``qmq_broker.recovery.repair`` rewrites the derived files. Run it while no broker
uses the directory (``qmq broker verify``, see docs/broker.md).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from qmq_broker.dedup.filter import FILTER_FILE, BloomFilter
from qmq_broker.dedup.runs import MappedRun, read_run_header, verify_run
from qmq_broker.delayed.recovery import HARMLESS, recover_schedule
from qmq_broker.errors import CorruptRecord, QmqBrokerError, StorageError
from qmq_broker.format.actions import is_action_record
from qmq_broker.format.files import (
    FORMAT_VERSION,
    KIND_DIRS,
    SegmentKind,
    list_segments,
    read_format,
    read_segment_header,
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
    index_chunk_path,
    list_index_chunks,
    list_indexed_subjects,
)
from qmq_broker.format.messages import MessageRecord, is_message_record
from qmq_broker.ordered.offline import inspect_route_files
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE, Checkpoint
from qmq_broker.storage.index_files import read_chunk

DERIVED = "derived file: --repair rebuilds it"


class NotADataDir(QmqBrokerError):
    """The path is not a readable broker data directory."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One piece of damage: where it is, what it is, and what it costs."""

    path: Path
    offset: int
    damage: str
    cost: str
    derived: bool = False  # in an index or checkpoint: --repair rebuilds it from the logs
    unreadable: int = 0  # stored messages whose record this damage makes unreadable (lost)

    def line(self) -> str:
        return f"{self.path} at {self.offset}: {self.damage}; {self.cost}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """What ``verify`` read and found."""

    data_dir: Path
    findings: tuple[Finding, ...]
    segments: int
    index_entries: int
    known_unreadable: int  # index entries recovery already marked unreadable on purpose

    @property
    def clean(self) -> bool:
        return not self.findings

    @property
    def unreadable(self) -> int:
        """Stored messages whose record is gone or corrupt: what the broker reports on start
        or dead-letters as ``unreadable record`` when pulled (known ones not counted)."""
        return sum(finding.unreadable for finding in self.findings)

    def summary(self) -> str:
        verdict = "clean" if self.clean else f"{len(self.findings)} damaged"
        if not self.clean:
            verdict += f", {self.unreadable} messages unreadable"
        return (
            f"{self.data_dir}: {verdict} ({self.segments} segments, "
            f"{self.index_entries} index entries, {self.known_unreadable} known unreadable)"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Indexed:
    """One index entry with the subject and seq it belongs to."""

    subject: str
    seq: int
    entry: IndexEntry
    path: Path

    @property
    def position(self) -> int:
        return INDEX_HEADER.size + (self.seq % INDEX_CHUNK_ENTRIES) * INDEX_ENTRY_SIZE

    @property
    def marked_unreadable(self) -> bool:
        """Recovery points a seq whose record is gone at the segment header on purpose."""
        return self.entry.offset == 0 and self.entry.length == FRAME_SIZE


def check_data_dir(data_dir: Path) -> None:
    """Raise ``NotADataDir`` unless ``data_dir`` holds a readable data directory of ours."""
    if not data_dir.is_dir():
        raise NotADataDir(f"{data_dir} is not a directory")
    try:
        version = read_format(data_dir)
    except StorageError as exc:
        raise NotADataDir(f"{data_dir} is not a broker data directory ({exc})") from exc
    if version is None:
        raise NotADataDir(f"{data_dir} is not a broker data directory (no FORMAT file)")
    if version != FORMAT_VERSION:
        raise NotADataDir(f"{data_dir} holds format {version}; this tool reads {FORMAT_VERSION}")


def verify(data_dir: Path) -> Report:
    """Check every file of a data directory; raise ``NotADataDir`` when it is not one."""
    check_data_dir(data_dir)
    try:
        return _verify(data_dir)
    except OSError as exc:
        raise NotADataDir(f"{data_dir} could not be read: {exc}") from exc


def _verify(data_dir: Path) -> Report:
    findings: list[Finding] = []
    findings += check_checkpoints(data_dir)
    findings += check_dedup_stores(data_dir)
    findings += check_route_files(data_dir)
    indexed, index_findings = read_indexes(data_dir)
    findings += index_findings
    by_segment: dict[int, list[Indexed]] = defaultdict(list)
    for item in indexed:
        by_segment[item.entry.segment].append(item)
    messages = list_segments(data_dir, SegmentKind.MESSAGES)
    findings += _missing_segments(data_dir, SegmentKind.MESSAGES, by_segment)
    findings += _missing_segments(data_dir, SegmentKind.ACTIONS, by_segment)
    subjects: set[str] = set()
    present = Present()
    unmatched: list[tuple[Path, Indexed, str]] = []
    for path in messages:
        found, seen, wrong = check_message_segment(
            path, by_segment.get(segment_number(path), []), present
        )
        findings += found
        subjects |= seen
        unmatched += ((path, item, why) for item, why in wrong)
    unmatched += _beyond_the_log(data_dir, messages, by_segment)
    findings += _unmatched(unmatched, present)
    findings += _unindexed_subjects(data_dir, subjects, {item.subject for item in indexed})
    actions = list_segments(data_dir, SegmentKind.ACTIONS)
    for index, path in enumerate(actions):
        findings += check_other_segment(path, SegmentKind.ACTIONS, last=index == len(actions) - 1)
    findings += check_delayed_files(data_dir)
    return Report(
        data_dir=data_dir,
        findings=tuple(findings),
        segments=sum(len(list_segments(data_dir, kind)) for kind in SegmentKind),
        index_entries=len(indexed),
        known_unreadable=sum(1 for item in indexed if item.marked_unreadable),
    )


# --- checkpoints -------------------------------------------------------------------------


def check_checkpoints(data_dir: Path) -> list[Finding]:
    bad: list[tuple[Path, str]] = []
    good = 0
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        path = data_dir / name
        if not path.exists():
            continue
        try:
            Checkpoint.decode(path.read_bytes(), path=str(path))
            good += 1
        except StorageError as exc:
            bad.append((path, str(exc).rpartition(" is unreadable: ")[2]))
    meanwhile = (
        "the broker starts from the other checkpoint meanwhile"
        if good
        else "the broker rebuilds from the logs meanwhile (longer start; redeliveries where "
        "retention removed early action segments)"
    )
    return [
        Finding(
            path=path,
            offset=0,
            damage=f"checkpoint does not check out ({why})",
            cost=f"{DERIVED}; {meanwhile}",
            derived=True,
        )
        for path, why in bad
    ]


# --- route tables ------------------------------------------------------------------------


def check_route_files(data_dir: Path) -> list[Finding]:
    """Ordered subjects' route tables and declarations (``qmq_broker.ordered.offline``)."""
    return [
        Finding(path=d.path, offset=0, damage=d.damage, cost=d.cost, derived=d.repairable)
        for d in inspect_route_files(data_dir)
    ]


# --- dedup stores --------------------------------------------------------------------------

_DEDUP_COST = "the broker rebuilds it from the index when it opens the store"


def check_dedup_stores(data_dir: Path) -> list[Finding]:
    """Every run's header and body CRCs, and each filter file's, of every subject."""
    findings: list[Finding] = []
    folder = data_dir / "dedup"
    for path in sorted(folder.glob("*/*.run")) if folder.is_dir() else []:
        try:
            header = read_run_header(path)
        except CorruptRecord as exc:
            findings.append(_dedup_finding(path, f"run header does not check out ({exc})"))
            continue
        findings += (_dedup_finding(path, p) for p in verify_run(MappedRun(path, header)))
    for path in sorted(folder.glob(f"*/{FILTER_FILE}")) if folder.is_dir() else []:
        try:
            BloomFilter.decode(path.read_bytes(), path=str(path))
        except CorruptRecord as exc:
            findings.append(_dedup_finding(path, f"filter does not check out ({exc})"))
    return findings


def _dedup_finding(path: Path, damage: str) -> Finding:
    return Finding(
        path=path, offset=0, damage=damage, cost=f"{DERIVED}; {_DEDUP_COST}", derived=True
    )


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
                _derived(
                    path,
                    0,
                    f"index chunk(s) of seqs {previous[1]}..{start - 1} missing",
                    f"seqs {previous[1]}..{start - 1} of {subject}",
                )
            )
        previous = (subject, start + INDEX_CHUNK_ENTRIES)
        found = read_chunk(path)
        if found is None:
            findings.append(_derived(path, 0, "index header unreadable", "every seq of it"))
            continue
        if not found.seal_matches():
            findings.append(
                _derived(path, 0, "index chunk does not match the CRC it was sealed with", "")
            )
        loose = (path.stat().st_size - INDEX_HEADER.size) % INDEX_ENTRY_SIZE
        if loose:
            at = INDEX_HEADER.size + len(found.entries)
            findings.append(_derived(path, at, f"{loose} bytes past the last whole entry", ""))
        indexed += (
            Indexed(
                subject, start + at // INDEX_ENTRY_SIZE, IndexEntry.decode(found.entries, at), path
            )
            for at in range(0, len(found.entries), INDEX_ENTRY_SIZE)
        )
    return indexed, findings


def _derived(path: Path, offset: int, damage: str, unreadable: str) -> Finding:
    cost = f"{unreadable} reads as unreadable until then; {DERIVED}" if unreadable else DERIVED
    return Finding(path=path, offset=offset, damage=damage, cost=cost, derived=True)


def _unindexed_subjects(data_dir: Path, in_log: set[str], indexed: set[str]) -> list[Finding]:
    return [
        _derived(
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
    header = _header_finding(path, data, SegmentKind.MESSAGES, len(entries))
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


def _unmatched(unmatched: list[tuple[Path, Indexed, str]], present: Present) -> list[Finding]:
    """Index entries that match no frame: a wrong entry when the log holds the record
    elsewhere (derived: the broker corrects it, ``--repair`` rebuilds it), else a message
    whose record is gone (the segment was cut, replaced or removed): unreadable, counted."""
    findings = []
    gone: dict[Path, list[Indexed]] = defaultdict(list)
    for segment, indexed, why in unmatched:
        seq = indexed.seq
        if present.holds(indexed.subject, seq):
            damage = f"entry for seq {seq} does not match the log ({why})"
            findings.append(_derived(indexed.path, indexed.position, damage, f"seq {seq}"))
        else:
            gone[segment].append(indexed)
    for segment, items in gone.items():
        seqs = defaultdict(list)
        for item in items:
            seqs[item.subject].append(item.seq)
        which = "; ".join(f"{subject} seqs {_ranges(sorted(s))}" for subject, s in seqs.items())
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


def _ranges(seqs: list[int]) -> str:
    """``1..3, 7`` for sorted ``[1, 2, 3, 7]``."""
    spans: list[list[int]] = []
    for seq in seqs:
        if spans and spans[-1][1] == seq - 1:
            spans[-1][1] = seq
        else:
            spans.append([seq, seq])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)


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


def _missing_segments(
    data_dir: Path, kind: SegmentKind, by_segment: dict[int, list[Indexed]]
) -> list[Finding]:
    """Numbers missing between two existing segments (retention removes only the oldest)."""
    numbers = [segment_number(path) for path in list_segments(data_dir, kind)]
    findings = []
    for low, high in itertools.pairwise(numbers):
        for number in range(low + 1, high):
            if kind is SegmentKind.MESSAGES:  # its entries are counted by ``_unmatched``
                lost = "the messages in it are unreadable"
            else:
                lost = "the group changes in it are lost (acks in it lost: redelivery)"
            cost = (
                f"{lost}; the broker starts only with --on-damage skip "
                f"(qmq broker --data-dir {data_dir} --on-damage skip)"
            )
            path = data_dir / KIND_DIRS[kind] / segment_name(number)
            findings.append(Finding(path=path, offset=0, damage="segment missing", cost=cost))
    return findings


def _beyond_the_log(
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


# --- delayed-message files (schedule, schedule-days, schedule-32days, dispatch) -------------


def check_delayed_files(data_dir: Path) -> list[Finding]:
    """What a broker start would find in the delayed-message files: the same scan, read-only,
    so the delayed messages counted lost here are the ones the broker counts unreadable."""
    scan = recover_schedule(data_dir, on_damage="skip", write=False)
    findings = [
        Finding(
            path=path,
            offset=0,
            damage=damage,
            cost="the broker starts only with --on-damage skip, which reads its records past "
            "the header (each keeps its own CRC)",
        )
        for path, damage in scan.headers
    ]
    findings += (
        Finding(
            path=lost.path,
            offset=lost.start,
            damage=f"corrupt bytes [{lost.start}, {lost.end})",
            cost=lost.cost(),
        )
        for lost in scan.unreadable
    )
    findings += (
        Finding(
            path=path,
            offset=start,
            damage=f"torn frame at offset {start}: a write a crash cut short",
            cost=f"never acknowledged; the broker cuts these {size - start} bytes on start",
        )
        for path, start, size in scan.torn
    )
    findings += (
        Finding(path=path, offset=start, damage=f"corrupt bytes [{start}, {end})", cost=HARMLESS)
        for path, start, end in scan.harmless
    )
    return findings


# --- action segments --------------------------------------------------------------------------

FRAME_CHECKS = {SegmentKind.ACTIONS: is_action_record}
COSTS = {SegmentKind.ACTIONS: "the group changes in it are lost (acks in it lost: redelivery)"}


def check_other_segment(path: Path, kind: SegmentKind, *, last: bool) -> list[Finding]:
    data = path.read_bytes()
    header = _header_finding(path, data, kind, None)
    if header is not None:
        return [header]
    findings = []
    for item in _regions(walk_frames(data, check=FRAME_CHECKS[kind])):
        cost = COSTS[kind]
        if kind is SegmentKind.ACTIONS and item.torn and last:
            cost += "; the broker cuts this torn tail at its next start"
        findings.append(Finding(path=path, offset=item.start, damage=item.reason, cost=cost))
    return findings


def _regions(walk: Iterator[tuple[int, bytes] | BadRegion]) -> Iterator[BadRegion]:
    return (item for item in walk if isinstance(item, BadRegion))


def _header_finding(
    path: Path, data: bytes, kind: SegmentKind, indexed: int | None
) -> Finding | None:
    try:
        found = read_segment_header(data, path=str(path))
    except CorruptRecord as exc:
        damage = exc.reason
    else:
        if found is kind:
            return None
        damage = f"a {found.name} segment in the {KIND_DIRS[kind]} directory"
    if kind is SegmentKind.MESSAGES:  # the reader checks frames, not the header
        cost = (
            "its frames are still read by their own CRCs; a broker that scans it on start "
            "(past the checkpoint) refuses to start until it is restored or the broker is "
            f"started with --on-damage skip (qmq broker --data-dir {path.parent.parent} "
            "--on-damage skip)"
        )
    else:
        cost = f"every record in it unreadable; {COSTS[kind]}"
    return Finding(path=path, offset=0, damage=damage, cost=cost)
