"""Logs kept as one segment per time bucket (the schedule and dispatch logs).

Unlike the message log, which appends to one segment at a time, a bucketed log appends to
whichever hour a record belongs to, so many segments are open for appends at once. The
placer (event-loop side) knows each open segment's end; the files (writer-thread side)
keep a bounded set of append descriptors.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

from qmq_broker.format.files import HEADER_SIZE, SegmentKind, segment_header
from qmq_broker.storage.fsync import sync_data, sync_new_file
from qmq_broker.storage.segments import Position, segment_path

BucketKey = tuple[SegmentKind, int]
MAX_OPEN_BUCKETS = 64


class BucketPlacer:
    """Hands out positions in bucketed logs; runs on the event loop."""

    def __init__(self, ends: dict[BucketKey, int] | None = None) -> None:
        self._ends: dict[BucketKey, int] = dict(ends or {})

    def place(self, kind: SegmentKind, bucket: int, length: int) -> Position:
        key = (kind, bucket)
        offset = self._ends.get(key, HEADER_SIZE)
        self._ends[key] = offset + length
        return Position(bucket, offset, length)

    def end(self, kind: SegmentKind, bucket: int) -> int:
        """Where the next record of a bucket will go (``HEADER_SIZE`` if it has none)."""
        return self._ends.get((kind, bucket), HEADER_SIZE)

    def forget(self, kind: SegmentKind, bucket: int) -> None:
        self._ends.pop((kind, bucket), None)


class BucketFiles:
    """Writer-thread side: append descriptors of bucket segments, least recently used closed."""

    def __init__(self, data_dir: Path, *, max_open: int = MAX_OPEN_BUCKETS) -> None:
        self._data_dir = data_dir
        self._max_open = max_open
        self._fds: collections.OrderedDict[BucketKey, int] = collections.OrderedDict()
        self.dirty: set[int] = set()

    def fd(self, kind: SegmentKind, bucket: int) -> int:
        key = (kind, bucket)
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        path = segment_path(self._data_dir, kind, bucket)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size == 0:
            os.pwrite(fd, segment_header(kind), 0)
            sync_new_file(fd, path)
        self._fds[key] = fd
        while len(self._fds) > self._max_open:
            _, old = self._fds.popitem(last=False)
            self._close(old)
        return fd

    def _close(self, fd: int) -> None:
        if fd in self.dirty:
            sync_data(fd)
            self.dirty.discard(fd)
        os.close(fd)

    def fsync(self) -> None:
        for fd in list(self.dirty):
            sync_data(fd)
        self.dirty.clear()

    def remove(self, kind: SegmentKind, bucket: int) -> None:
        """Close a bucket segment's descriptor and delete the file."""
        fd = self._fds.pop((kind, bucket), None)
        if fd is not None:
            self.dirty.discard(fd)
            os.close(fd)
        path = segment_path(self._data_dir, kind, bucket)
        path.unlink(missing_ok=True)

    def close(self) -> None:
        for fd in self._fds.values():
            self._close(fd)
        self._fds.clear()
