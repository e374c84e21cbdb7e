"""One broker log segment as its records and its unreadable regions.

The walk is the broker's own (``qmq_broker.format.walk_frames``): a frame that is cut short,
fails its CRC or does not decode as a record of the segment's kind starts an unreadable
region, and the walk resynchronises on the next valid frame, so one flipped byte costs
the record it hit, not the rest of the segment.

A region with no valid frame after it, in the last segment of its log, is a torn tail: a
write cut short by a crash (the broker truncates it when it next starts) or the record a
running broker is writing. It is not damage and is not yielded. Every other region is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

from qmq_broker.errors import CorruptRecord
from qmq_broker.format import (
    ActionRecord,
    BadRegion,
    MessageFields,
    SegmentKind,
    message_fields,
    read_segment,
    walk_frames,
)

RecordT = TypeVar("RecordT")


class _DecodingCheck(Generic[RecordT]):
    """The walk's frame check: a frame is valid when its payload decodes. The record is
    kept, so the payload the walk then yields is not decoded a second time."""

    def __init__(self, decode: Callable[[bytes], RecordT]) -> None:
        self._decode = decode
        self._payload: bytes | None = None
        self._record: RecordT | None = None

    def __call__(self, payload: bytes) -> bool:
        try:
            record = self._decode(payload)
        except CorruptRecord:
            return False
        self._payload, self._record = payload, record
        return True

    def record(self, payload: bytes) -> RecordT:
        if payload is self._payload and self._record is not None:
            return self._record
        return self._decode(payload)


def is_damage(region: BadRegion, *, last_segment: bool) -> bool:
    """Whether a region is damage to report, rather than the torn tail of the last segment."""
    return not (region.torn and last_segment)


def _scan(
    path: Path,
    kind: SegmentKind,
    decode: Callable[[bytes], RecordT],
    *,
    last_segment: bool,
) -> Iterator[tuple[int, RecordT] | BadRegion]:
    data, found = read_segment(path)
    if found is not kind:
        raise CorruptRecord(path=str(path), offset=0, reason=f"a {found.name} segment")
    check = _DecodingCheck(decode)
    for item in walk_frames(data, check=check):
        if isinstance(item, BadRegion):
            if is_damage(item, last_segment=last_segment):
                yield item
            continue
        offset, payload = item
        yield offset, check.record(payload)


def scan_messages(
    path: Path, *, last_segment: bool
) -> Iterator[tuple[int, MessageFields] | BadRegion]:
    """``(offset, fields)`` for every readable message (``qmq_broker.format.message_fields``: a
    plain tuple, no record object per message), a ``BadRegion`` for the damage."""
    return _scan(path, SegmentKind.MESSAGES, message_fields, last_segment=last_segment)


def scan_actions(
    path: Path, *, last_segment: bool
) -> Iterator[tuple[int, ActionRecord] | BadRegion]:
    """``(offset, record)`` for every readable action record, a ``BadRegion`` for the damage."""
    return _scan(path, SegmentKind.ACTIONS, ActionRecord.decode, last_segment=last_segment)
