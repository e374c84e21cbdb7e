"""Reading bucket segments without decoding whole messages (recovery and bucket loads).

Runs on worker threads. Files are memory-mapped and walked frame by frame. After a frame
that is cut short or fails its CRC the walk resynchronises on the next valid record, as the
message log's does (``qmq_broker.format.frames.next_valid_frame``): corrupt bytes in the
middle cost the records in them. At the end, only a frame the file does not hold whole is a
torn tail (a write a crash cut short, never acknowledged); a whole frame there that fails
its CRC is damage, kept like damage in the middle. Segment headers are checked by recovery,
not here.
"""

from __future__ import annotations

import contextlib
import mmap
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path

from qmq_broker.format.files import HEADER_SIZE, SegmentKind
from qmq_broker.format.frames import FRAME, FRAME_SIZE, MAX_PAYLOAD, FrameCheck, next_valid_frame
from qmq_broker.format.schedule import (
    DispatchRecord,
    ScheduleRecord,
    is_dispatch_record,
    is_schedule_record,
)
from qmq_broker.storage.segments import segment_path


class FrameWalk:
    """Iterates ``(offset, body_at, length)`` of whole frames of ``buf``.

    Afterwards ``valid_end`` and ``problem`` say where the readable part ended and why (a
    torn tail), and ``skipped`` lists the ``(start, end)`` of corrupt bytes walked past.
    Yields positions, not slices, so no view of a mapped file outlives the mapping.
    """

    def __init__(
        self,
        buf: bytes | mmap.mmap,
        *,
        start: int = HEADER_SIZE,
        end: int | None = None,
        check: FrameCheck | None = None,
    ) -> None:
        self._buf = buf
        self._start = start
        self._end = len(buf) if end is None else min(end, len(buf))
        self._check = check
        self.valid_end = start
        self.problem: str | None = None
        self.skipped: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        buf = self._buf
        offset, end = self._start, self._end
        while offset < end:
            length = self._whole_frame(offset, end)
            if length is None:
                following = next_valid_frame(buf, offset + 1, end, self._check)
                if following is None:
                    following = self._damaged_last(offset, end)
                if following is None:
                    self.problem = f"torn frame at offset {offset}"
                    return
                self.skipped.append((offset, following))
                offset = following
                if following == end:
                    self.valid_end = end
                continue
            yield offset, offset + FRAME_SIZE, length
            offset += FRAME_SIZE + length
            self.valid_end = offset

    def _damaged_last(self, offset: int, end: int) -> int | None:
        """Where a damaged frame at ``offset`` with nothing valid after it ends, when it is
        whole: its declared length fits, or the bytes to ``end`` match its CRC (its length
        was hit). None when the file does not hold it whole: a torn write."""
        if offset + FRAME_SIZE > end:
            return None
        length, crc = FRAME.unpack_from(self._buf, offset)
        if zlib.crc32(self._buf[offset + FRAME_SIZE : end]) == crc:
            return end
        if 0 < length <= MAX_PAYLOAD and offset + FRAME_SIZE + length <= end:
            return offset + FRAME_SIZE + int(length)
        return None

    def _whole_frame(self, offset: int, end: int) -> int | None:
        """The payload length of a whole, CRC-valid frame at ``offset``, else None."""
        if offset + FRAME_SIZE > end:
            return None
        length, crc = FRAME.unpack_from(self._buf, offset)
        body = offset + FRAME_SIZE
        if length == 0 or length > MAX_PAYLOAD or body + length > end:
            return None
        if zlib.crc32(self._buf[body : body + length]) != crc:  # a bytes copy: no view escapes
            return None
        return int(length)


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """A segment's bytes, memory-mapped (recovery has checked its header, or read past it)."""
    with open(path, "rb") as handle:
        if handle.seek(0, 2) <= HEADER_SIZE:
            handle.seek(0)
            yield handle.read()
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
    with mapped(path) as buf:
        for offset, body, length in FrameWalk(buf, end=end, check=is_dispatch_record):
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
    with mapped(path) as buf:
        for offset, body, length in FrameWalk(buf, end=end, check=is_schedule_record):
            if offset in dispatched:
                continue
            deliver, _ = ScheduleRecord.peek(buf, body, path=str(path), offset=offset)
            out.extend((deliver, offset, FRAME_SIZE + length))
    return out


def read_payloads(
    data_dir: Path,
    kind: SegmentKind,
    bucket: int,
    *,
    start: int,
    end: int,
    skip: set[int],
    max_bytes: int,
) -> tuple[list[bytes], int]:
    """Payloads of a coarse bucket's schedule records from ``start`` (those at offsets in
    ``skip`` left out), about ``max_bytes`` of them, and where the next chunk starts
    (``end`` once the segment is read)."""
    path = segment_path(data_dir, kind, bucket)
    out: list[bytes] = []
    if not path.exists():
        return out, end
    size = 0
    with mapped(path) as buf:
        for offset, body, length in FrameWalk(buf, start=start, end=end, check=is_schedule_record):
            if offset not in skip:
                out.append(bytes(buf[body : body + length]))
                size += length
            if size >= max_bytes:
                return out, offset + FRAME_SIZE + length
    return out, end
