"""Segment files: where an append lands, and reading a frame back by position."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec

from qmq_broker.errors import CorruptRecord, StorageError
from qmq_broker.format.files import (
    HEADER_SIZE,
    KIND_DIRS,
    SegmentKind,
    read_segment_header,
    segment_name,
)
from qmq_broker.format.frames import FRAME_SIZE, BadRegion, read_frame_at, walk_frames
from qmq_broker.format.messages import is_message_record


class Position(msgspec.Struct, frozen=True, gc=False):
    """A frame's place in a log: segment number, byte offset, frame length.

    A frozen msgspec struct rather than a frozen dataclass: one is built for every append,
    and a struct is much cheaper to build.
    """

    segment: int
    offset: int
    length: int


class LogPlacer:
    """Hands out positions for appends to one log, rolling segments by size.

    Runs on the event loop: positions are known when a record is accepted, before it is
    written, so the index and checkpoints can refer to them.
    """

    def __init__(self, *, segment_bytes: int, segment: int, end_offset: int) -> None:
        self._segment_bytes = segment_bytes
        self.segment = segment
        self.end_offset = end_offset

    def place(self, length: int) -> Position:
        if self.end_offset > HEADER_SIZE and self.end_offset + length > self._segment_bytes:
            self.segment += 1
            self.end_offset = HEADER_SIZE
        position = Position(self.segment, self.end_offset, length)
        self.end_offset += length
        return position

    def place_run(self, length: int) -> tuple[int, int] | None:
        """``(segment, offset)`` for ``length`` bytes of frames one after the other, when
        they all fit in the current segment; None when it would roll part way (``place``
        each frame then)."""
        if self.end_offset + length > self._segment_bytes:
            return None
        at = self.end_offset
        self.end_offset = at + length
        return self.segment, at

    def tell(self) -> tuple[int, int]:
        return self.segment, self.end_offset


def segment_path(data_dir: Path, kind: SegmentKind, number: int) -> Path:
    return data_dir / KIND_DIRS[kind] / segment_name(number)


_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)  # Linux 4.14+
_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
# Whether ``cached_only`` reads can succeed here: elsewhere every one raises ``NotCached``.
CACHED_READS = _RWF_NOWAIT is not None


def message_frames(path: Path) -> Iterator[tuple[int, bytes]]:
    """Every good frame of a message segment read whole, as (offset, payload): bad regions
    left out, nothing from a file whose header does not read as a message segment's."""
    data = path.read_bytes()
    try:
        if read_segment_header(data, path=str(path)) is not SegmentKind.MESSAGES:
            return
    except CorruptRecord:
        return
    for item in walk_frames(data, check=is_message_record):
        if not isinstance(item, BadRegion):
            yield item


class NotCached(Exception):
    """A ``cached_only`` read would have waited for the disk (or this platform cannot
    tell): read it where waiting is allowed."""


def _pread(fd: int, length: int, offset: int, cached_only: bool) -> bytes | memoryview:
    """``length`` bytes at ``offset``; a cached-only read hands back its buffer as it is
    (every frame in it is copied out once more when its CRC is checked)."""
    if not cached_only:
        return os.pread(fd, length, offset)
    if _RWF_NOWAIT is None:
        raise NotCached
    buffer = bytearray(length)
    try:
        got = os.preadv(fd, [buffer], offset, _RWF_NOWAIT)
    except BlockingIOError:
        raise NotCached from None
    if got < length:  # partly cached, or past the end: the plain read decides which
        raise NotCached
    return memoryview(buffer)


class SegmentReader:
    """Reads frames by position with cached read-only descriptors (``pread`` is thread-safe).

    ``cached_only``: read only what is in the page cache (``RWF_NOWAIT``), else raise
    ``NotCached``, so that the event loop can serve hot reads itself and leave the rest to
    a read thread."""

    def __init__(self, data_dir: Path, kind: SegmentKind) -> None:
        self._data_dir = data_dir
        self._kind = kind
        self._files: dict[int, tuple[int, str]] = {}  # segment -> (fd, path for errors)
        self._lock = threading.Lock()

    def _file(self, segment: int) -> tuple[int, str]:
        found = self._files.get(segment)
        if found is None:
            with self._lock:
                found = self._files.get(segment)
                if found is None:
                    path = segment_path(self._data_dir, self._kind, segment)
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except FileNotFoundError as exc:
                        raise StorageError(f"segment {path} is gone (retention)") from exc
                    found = self._files[segment] = (fd, str(path))
        return found

    def read(self, segment: int, offset: int, length: int, *, cached_only: bool = False) -> bytes:
        """The payload of the frame at a position, CRC-checked."""
        fd, path = self._file(segment)
        data = _pread(fd, length, offset, cached_only)
        if len(data) < FRAME_SIZE:
            raise CorruptRecord(path=path, offset=offset, reason="frame beyond end of segment")
        return read_frame_at(data, offset=offset, path=path)

    def read_run(
        self, segment: int, offset: int, length: int, *, cached_only: bool = False
    ) -> bytes | memoryview:
        """Raw bytes of adjacent frames (still framed: the caller checks each CRC)."""
        return _pread(self._file(segment)[0], length, offset, cached_only)

    def read_ahead(self, segment: int, offset: int, length: int) -> None:
        """Ask the kernel to bring a range into the page cache in the background
        (``POSIX_FADV_WILLNEED``), without waiting for it; a later ``cached_only`` read
        finds it there. Nothing happens where the platform has no such advice or the
        segment is gone (the read that follows reports that)."""
        if _WILLNEED is None:
            return
        try:
            fd, _ = self._file(segment)
            os.posix_fadvise(fd, offset, length, _WILLNEED)
        except (StorageError, OSError):
            pass

    def forget(self, segment: int) -> None:
        with self._lock:
            found = self._files.pop(segment, None)
        if found is not None:
            os.close(found[0])

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
        for fd, _ in files.values():
            os.close(fd)
