"""Frames ``[u32 payload length][u32 crc32(payload)][payload]`` and walking a segment's.

A frame that is cut short or whose CRC does not match is never returned as a record;
``walk_frames`` reads on past it and says where and why, and stops quietly at the writer's
room (zero bytes to the end: no frame has length 0).
"""

from __future__ import annotations

import dataclasses
import mmap
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

# ISA-L's CRC-32 is zlib's function (same polynomial and values: the format is unchanged) at
# a fifth of its cost on a 1 KiB frame; zlib's took about 4 % of the broker's CPU under load
from isal.isal_zlib import crc32 as crc32  # re-exported: tests hold it to zlib's values

from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import HEADER_SIZE, SegmentKind, read_segment

FRAME = struct.Struct("<II")  # payload length, crc32
FRAME_SIZE = FRAME.size
MAX_PAYLOAD = 64 * 1024 * 1024
_LENGTH = struct.Struct("<I")  # a frame's first field alone

FrameCheck = Callable[[bytes], bool]
Record = TypeVar("Record")


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload), crc32(payload)) + payload


def read_frame_at(data: bytes | memoryview, *, offset: int, path: str) -> bytes:
    """Read one frame at a known offset, verifying its CRC."""
    if len(data) < FRAME_SIZE:
        raise CorruptRecord(path=path, offset=offset, reason="frame header cut short")
    length, crc = FRAME.unpack_from(data, 0)
    payload = bytes(data[FRAME_SIZE : FRAME_SIZE + length])
    if len(payload) != length:
        raise CorruptRecord(path=path, offset=offset, reason="frame cut short")
    if crc32(payload) != crc:
        raise CorruptRecord(path=path, offset=offset, reason="CRC mismatch")
    return payload


def iter_frames(data: bytes, *, path: str, start: int = HEADER_SIZE) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, payload)`` for every whole, CRC-valid frame from ``start``.

    Stops at the first frame that is cut short or fails its CRC; ``walk_frames`` reads on
    past it and says where and why.
    """
    size = len(data)
    offset = start
    while offset < size:
        payload = _frame_at(data, offset, size)
        if payload is None:
            return
        yield offset, payload
        offset += FRAME_SIZE + len(payload)


def iter_records(
    path: Path, kind: SegmentKind, decode: Callable[..., Record]
) -> Iterator[tuple[int, Record]]:
    """Every whole record of a ``kind`` segment file with its offset, read by ``decode``."""
    data, found = read_segment(path)
    if found is not kind:
        raise CorruptRecord(path=str(path), offset=0, reason=f"a {found.name} segment")
    for offset, payload in iter_frames(data, path=str(path)):
        yield offset, decode(payload, path=str(path), offset=offset)


def record_check(decode: Callable[[bytes], object]) -> FrameCheck:
    """A frame check for ``walk_frames``: the payload decodes (``CorruptRecord`` otherwise)."""

    def check(payload: bytes) -> bool:
        try:
            decode(payload)
        except CorruptRecord:
            return False
        return True

    return check


@dataclasses.dataclass(frozen=True, slots=True)
class BadRegion:
    """Bytes of a segment that hold no readable frame: ``[start, end)``.

    ``end`` is where the next valid frame starts, or the end of the data when none follows
    (then the region is a torn tail if the segment is the last one).
    """

    start: int
    end: int
    torn: bool  # no valid frame follows: a torn tail, if the segment is the last one

    @property
    def reason(self) -> str:
        if self.torn:
            return f"torn or corrupt frame at offset {self.start}; nothing valid follows"
        return f"corrupt bytes [{self.start}, {self.end}); valid frames follow"


def walk_frames(
    data: bytes, *, start: int = HEADER_SIZE, check: FrameCheck | None = None
) -> Iterator[tuple[int, bytes] | BadRegion]:
    """Every valid frame from ``start`` as ``(offset, payload)``, and every bad region between.

    Frames in sequence are trusted by their CRC. After a frame that is cut short or fails
    its CRC, the walk resynchronises: it looks for the next offset where a whole frame with
    a matching CRC starts, whose payload passes ``check`` (e.g. decodes as a record of the
    segment's kind), and whose end is followed by another valid frame or by the end of the
    data. So one flipped bit costs the frame it hit, not every frame after it, and a torn
    tail is a bad region with no valid frame after it (``BadRegion.torn``). Zero bytes from
    where a frame should start to the end are the writer's room, not a region: the walk
    ends there.
    """
    size = len(data)
    offset = start
    while offset < size:
        payload = _frame_at(data, offset, size)
        if payload is not None:
            yield offset, payload
            offset += FRAME_SIZE + len(payload)
            continue
        if _all_zero(data, offset, size):
            return
        following = next_valid_frame(data, offset + 1, size, check)
        if following is None:
            yield BadRegion(offset, size, torn=True)
            return
        yield BadRegion(offset, following, torn=False)
        offset = following


_NONZERO = re.compile(rb"[^\x00]")


def _all_zero(data: bytes | mmap.mmap, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` is all zero bytes (room), read without a copy."""
    return _NONZERO.search(data, start, end) is None


def _frame_at(data: bytes | mmap.mmap, offset: int, size: int) -> bytes | None:
    if offset + FRAME_SIZE > size:
        return None
    length, crc = FRAME.unpack_from(data, offset)
    body_start = offset + FRAME_SIZE
    if length == 0 or length > MAX_PAYLOAD or body_start + length > size:
        return None
    payload = data[body_start : body_start + length]
    return payload if crc32(payload) == crc else None


def next_valid_frame(
    data: bytes | mmap.mmap, offset: int, size: int, check: FrameCheck | None
) -> int | None:
    """The first offset in ``[offset, size)`` where a whole, CRC-valid frame starts whose
    payload passes ``check`` and which is followed by another valid frame, ``size`` or only
    zero bytes (room). Runs of zero bytes are skipped whole: no frame's length is 0."""
    while offset + FRAME_SIZE <= size:
        (length,) = _LENGTH.unpack_from(data, offset)
        if length == 0:
            nonzero = _NONZERO.search(data, offset + 4, size)
            if nonzero is None:
                return None
            # a frame starts at most 3 bytes before its length's first nonzero byte
            offset = max(offset + 1, nonzero.start() - 3)
            continue
        payload = _frame_at(data, offset, size)
        if payload is not None and (check is None or check(payload)):
            after = offset + FRAME_SIZE + len(payload)
            if (
                after == size
                or _frame_at(data, after, size) is not None
                or _all_zero(data, after, size)
            ):
                return offset
        offset += 1
    return None
