"""Offline check of a broker data directory (like ``fsck``): what is damaged, what it costs.

Reads every segment (message, action, schedule, dispatch), every index entry and both
checkpoints, opening each file read-only, and returns a ``Report`` of ``Finding``s. It
never writes; ``qmq_broker.recovery.repair`` rewrites the derived files. Run it while no broker
uses the directory (``qmq broker verify``, see docs/broker.md).
"""

from __future__ import annotations

import dataclasses
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
    SegmentKind,
    list_segments,
    read_format,
    segment_number,
)
from qmq_broker.format.frames import BadRegion, walk_frames
from qmq_broker.ordered.offline import inspect_route_files
from qmq_broker.recovery.findings import COSTS, DERIVED, Finding, header_finding
from qmq_broker.recovery.verify_log import (
    Indexed,
    Present,
    beyond_the_log,
    check_message_segment,
    missing_segments,
    read_indexes,
    unindexed_subjects,
    unmatched_entries,
)
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE, Checkpoint


class NotADataDir(QmqBrokerError):
    """The path is not a readable broker data directory."""


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
    findings += missing_segments(data_dir, SegmentKind.MESSAGES, by_segment)
    findings += missing_segments(data_dir, SegmentKind.ACTIONS, by_segment)
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
    unmatched += beyond_the_log(data_dir, messages, by_segment)
    findings += unmatched_entries(unmatched, present)
    findings += unindexed_subjects(data_dir, subjects, {item.subject for item in indexed})
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


def check_other_segment(path: Path, kind: SegmentKind, *, last: bool) -> list[Finding]:
    data = path.read_bytes()
    header = header_finding(path, data, kind)
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
