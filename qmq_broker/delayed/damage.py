"""What damage in a delayed-message file costs, read alike by recovery and ``verify``.

A schedule record in damaged bytes is a delayed message that can never be delivered: it is
counted (per subject when the record still names it) and logged with its file and byte
range. A damaged dispatch record costs nothing lasting: the messages it listed go out again
and the subject's id dedup stores none twice. A header that is not the directory's kind is
reported; recovery reads past it only with ``--on-damage skip``.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Callable
from pathlib import Path

from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import KIND_DIRS, SegmentKind, read_segment_header
from qmq_broker.format.frames import FRAME, FRAME_SIZE
from qmq_broker.format.schedule import ScheduleRecord, schedule_key

Buffer = bytes | mmap.mmap
# whether a record at an offset (with its subject and id when they read) is already done
# with: dispatched, or copied into a finer bucket before a crash
Done = Callable[[int, tuple[str, str] | None], bool]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Unreadable:
    """One record lost to damaged bytes ``[start, end)`` of a bucket segment.

    ``subject`` and ``message_id`` are known when the record still reads them and they hash
    to its key (the damage hit its body, say).
    """

    path: Path
    kind: SegmentKind
    start: int
    end: int
    subject: str | None = None
    message_id: str | None = None
    records: int = 1  # more than one only for a cut (``cut``): how many its tally misses
    cut: bool = False  # the segment ends before its tally says: the records after are gone

    @property
    def lost(self) -> bool:
        """A delayed message that will never be delivered (not a dispatch record)."""
        return self.kind is not SegmentKind.DISPATCH

    def cost(self) -> str:
        if self.cut:
            return (
                f"{self.records} delayed messages gone: the file ends at {self.start} but its "
                f"tally says it held records to {self.end}; never delivered, counted as "
                "unreadable in GET /v1/schedule; the rest is kept"
            )
        if not self.lost:
            return (
                "a dispatch record unreadable: the delayed messages it listed go out again, "
                "answered as duplicates within the dedup window"
            )
        named = f" ({self.subject!r}, id {self.message_id!r})" if self.subject else ""
        return (
            f"1 delayed message unreadable{named}: never delivered, counted as unreadable in "
            "GET /v1/schedule and its subject's scheduled stats; the rest is kept"
        )

    def line(self) -> str:
        if self.cut:
            return f"{self.path}: cut short at {self.start}; {self.cost()}"
        return f"{self.path}: corrupt bytes [{self.start}, {self.end}); {self.cost()}"


def header_damage(head: bytes, kind: SegmentKind, *, path: Path) -> str | None:
    """What is wrong with a bucket segment's header, or None when it names ``kind``."""
    try:
        found = read_segment_header(head, path=str(path))
    except CorruptRecord as exc:
        return exc.reason
    if found is not kind:
        return f"a {found.name} segment header in the {KIND_DIRS[kind]} directory"
    return None


def unreadable_records(
    buf: Buffer, *, path: Path, kind: SegmentKind, start: int, end: int, done: Done
) -> list[Unreadable]:
    """The records lost in damaged bytes ``[start, end)``, those already done with left out.

    Where the frames' lengths still step exactly from ``start`` to ``end`` each is one
    record; otherwise the bytes count as one record (at least one was there).
    """
    found = []
    for at, after in record_bounds(buf, start, end):
        dispatch = kind is SegmentKind.DISPATCH
        identity = None if dispatch else ScheduleRecord.identity(buf, at + FRAME_SIZE)
        if done(at, identity):
            continue
        subject, message_id = identity if identity is not None else (None, None)
        found.append(
            Unreadable(
                path=path, kind=kind, start=at, end=after, subject=subject, message_id=message_id
            )
        )
    return found


def record_bounds(buf: Buffer, start: int, end: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each record in damaged bytes, as far as frame lengths tell."""
    bounds = []
    at = start
    while at + FRAME_SIZE <= end:
        (length, _) = FRAME.unpack_from(buf, at)
        if length == 0 or at + FRAME_SIZE + length > end:
            break
        bounds.append((at, at + FRAME_SIZE + length))
        at += FRAME_SIZE + length
    return bounds if bounds and at == end else [(start, end)]


def moved_or_dispatched(done: set[int], ids: Callable[[int], bool]) -> Done:
    """A ``Done`` for a bucket: offsets its dispatch log lists, or records whose key is
    already waiting elsewhere (a copy made by a move)."""

    def check(at: int, identity: tuple[str, str] | None) -> bool:
        if at in done:
            return True
        return identity is not None and ids(schedule_key(*identity))

    return check
