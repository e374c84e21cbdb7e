"""Reading bucket segments without decoding whole messages (recovery and bucket loads).

Runs on worker threads. Files are memory-mapped and walked frame by frame; a frame that is
cut short or fails its CRC ends the readable part, like everywhere else in the broker.
"""

from __future__ import annotations

import contextlib
import mmap
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path

from broker.errors import StorageError
from broker.format import (
    FRAME,
    FRAME_SIZE,
    HEADER_SIZE,
    MAX_PAYLOAD,
    DispatchRecord,
    ScheduleRecord,
    SegmentKind,
    read_segment_header,
)
from broker.storage.segments import segment_path


class FrameWalk:
    """Iterates ``(offset, body_at, length)`` of whole frames of ``buf``.

    Afterwards ``valid_end`` and ``problem`` say where the readable part ended and why.
    Yields positions, not slices, so no view of a mapped file outlives the mapping.
    """

    def __init__(
        self, buf: bytes | mmap.mmap, *, start: int = HEADER_SIZE, end: int | None = None
    ) -> None:
        self._buf = buf
        self._start = start
        self._end = len(buf) if end is None else min(end, len(buf))
        self.valid_end = start
        self.problem: str | None = None

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        buf = self._buf
        offset, end = self._start, self._end
        while offset < end:
            if offset + FRAME_SIZE > end:
                self.problem = f"frame header cut short at offset {offset}"
                return
            length, crc = FRAME.unpack_from(buf, offset)
            body = offset + FRAME_SIZE
            if length == 0 or length > MAX_PAYLOAD or body + length > end:
                self.problem = f"torn frame at offset {offset}"
                return
            if zlib.crc32(buf[body : body + length]) != crc:  # a bytes copy: no view escapes
                self.problem = f"CRC mismatch at offset {offset}"
                return
            yield offset, body, length
            offset = body + length
            self.valid_end = offset


@contextlib.contextmanager
def mapped(path: Path, kind: SegmentKind) -> Iterator[bytes | mmap.mmap]:
    """A segment's bytes, memory-mapped, after checking its header names ``kind``."""
    with open(path, "rb") as handle:
        head = handle.read(HEADER_SIZE)
        found = read_segment_header(head, path=str(path))
        if found is not kind:
            raise StorageError(f"{path} is a {found.name} segment, not a {kind.name} one")
        if handle.seek(0, 2) == HEADER_SIZE:
            yield head
            return
        buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield buf
        finally:
            buf.close()


def dispatched_offsets(data_dir: Path, bucket: int, *, end: int | None = None) -> set[int]:
    """Offsets of the bucket's schedule records that its dispatch segment lists."""
    path = segment_path(data_dir, SegmentKind.DISPATCH, bucket)
    if not path.exists():
        return set()
    done: set[int] = set()
    with mapped(path, SegmentKind.DISPATCH) as buf:
        for offset, body, length in FrameWalk(buf, end=end):
            payload = bytes(buf[body : body + length])
            done.update(DispatchRecord.decode(payload, path=str(path), offset=offset).offsets)
    return done


def pending_entries(data_dir: Path, bucket: int, *, end: int, dispatched: set[int]) -> array[int]:
    """Packed ``(deliver_at_us, offset, length)`` of the bucket's undispatched records
    before ``end``."""
    out = array("q")
    path = segment_path(data_dir, SegmentKind.SCHEDULE, bucket)
    if not path.exists():
        return out
    with mapped(path, SegmentKind.SCHEDULE) as buf:
        for offset, body, length in FrameWalk(buf, end=end):
            if offset in dispatched:
                continue
            deliver, _ = ScheduleRecord.peek(buf, body, path=str(path), offset=offset)
            out.extend((deliver, offset, FRAME_SIZE + length))
    return out
