"""Logs kept as one segment per time bucket (the schedule and dispatch logs).

Unlike the message log, which appends to one segment at a time, a bucketed log appends to
whichever hour a record belongs to, so many segments are open for appends at once. The
placer (event-loop side) knows each open segment's end and record count; the files
(writer-thread side) keep a bounded set of append descriptors, and write each schedule
segment's tally (``qmq_broker.format.schedule.BucketTally``) into its slot of
``schedule/tallies`` after the batch that grew it. Tallies are fsynced only with
checkpoints and on close, like indexes: a kill -9 leaves them exact, and after a power cut
one may lag its segment, which costs only evidence.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import HEADER_SIZE, KIND_DIRS, SegmentKind, segment_header
from qmq_broker.format.schedule import (
    EMPTY_TALLY,
    SCHEDULE_KINDS,
    TALLIES_FILE,
    TALLY_SIZE,
    BucketTally,
)
from qmq_broker.storage.fsync import sync_data, sync_new_file
from qmq_broker.storage.segments import Position, segment_path

BucketKey = tuple[SegmentKind, int]
MAX_OPEN_BUCKETS = 64


def tallies_path(data_dir: Path) -> Path:
    return data_dir / KIND_DIRS[SegmentKind.SCHEDULE] / TALLIES_FILE


class BucketPlacer:
    """Hands out positions in bucketed logs; runs on the event loop.

    ``records`` counts each schedule segment's records (recovery's count to begin with),
    for its tally.
    """

    def __init__(
        self,
        ends: dict[BucketKey, int] | None = None,
        records: dict[BucketKey, int] | None = None,
    ) -> None:
        self._ends: dict[BucketKey, int] = dict(ends or {})
        self._records: dict[BucketKey, int] = dict(records or {})

    def place(self, kind: SegmentKind, bucket: int, length: int) -> Position:
        key = (kind, bucket)
        offset = self._ends.get(key, HEADER_SIZE)
        self._ends[key] = offset + length
        self._records[key] = self._records.get(key, 0) + 1
        return Position(bucket, offset, length)

    def tally(self, kind: SegmentKind, bucket: int) -> BucketTally | None:
        """What a schedule segment holds so far (None for a dispatch segment: losing its
        records costs nothing lasting, so it keeps no tally)."""
        if kind not in SCHEDULE_KINDS:
            return None
        key = (kind, bucket)
        return BucketTally(
            kind=kind,
            bucket=bucket,
            end=self._ends.get(key, HEADER_SIZE),
            records=self._records.get(key, 0),
        )

    def end(self, kind: SegmentKind, bucket: int) -> int:
        """Where the next record of a bucket will go (``HEADER_SIZE`` if it has none)."""
        return self._ends.get((kind, bucket), HEADER_SIZE)

    def forget(self, kind: SegmentKind, bucket: int) -> None:
        self._ends.pop((kind, bucket), None)
        self._records.pop((kind, bucket), None)


class BucketFiles:
    """Writer-thread side: append descriptors of bucket segments, least recently used closed."""

    def __init__(self, data_dir: Path, *, max_open: int = MAX_OPEN_BUCKETS) -> None:
        self._data_dir = data_dir
        self._max_open = max_open
        self._fds: collections.OrderedDict[BucketKey, int] = collections.OrderedDict()
        self.dirty: set[int] = set()
        self._tallies = _TallySlots(tallies_path(data_dir))

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

    def write_tally(self, tally: BucketTally) -> None:
        """Write a schedule segment's tally in its slot (after the batch that grew it)."""
        self._tallies.write(tally)

    def fsync_tallies(self) -> None:
        self._tallies.fsync()

    def remove(self, kind: SegmentKind, bucket: int) -> None:
        """Close a bucket segment's descriptor and delete the file, its tally first (a
        segment without a tally claims nothing; a tally without its segment, a loss)."""
        key = (kind, bucket)
        self._tallies.free(key)
        fd = self._fds.pop(key, None)
        if fd is not None:
            self.dirty.discard(fd)
            os.close(fd)
        path = segment_path(self._data_dir, kind, bucket)
        path.unlink(missing_ok=True)

    def close(self) -> None:
        for fd in self._fds.values():
            self._close(fd)
        self._fds.clear()
        self._tallies.close()


class _TallySlots:
    """The tallies file, opened on first use: a slot per schedule segment, found by the
    tally it holds, freed (zeroed) when its segment is deleted and then reused."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None
        self._slots: dict[BucketKey, int] = {}
        self._free: list[int] = []
        self._size = 0

    def _open(self) -> int:
        if self._fd is not None:
            return self._fd
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        self._size = len(data) - len(data) % TALLY_SIZE
        for at in range(0, self._size, TALLY_SIZE):
            key = _slot_key(data[at : at + TALLY_SIZE])
            if key is None or key in self._slots:
                self._free.append(at)
            else:
                self._slots[key] = at
        return fd

    def write(self, tally: BucketTally) -> None:
        fd = self._open()
        at = self._slots.get(tally.key)
        if at is None:
            at = self._slots[tally.key] = self._free.pop() if self._free else self._grow()
        os.pwrite(fd, tally.encode(), at)

    def _grow(self) -> int:
        at = self._size
        self._size += TALLY_SIZE
        return at

    def free(self, key: BucketKey) -> None:
        fd = self._open()  # a slot from before this start is found there too
        at = self._slots.pop(key, None)
        if at is not None:
            os.pwrite(fd, EMPTY_TALLY, at)
            self._free.append(at)

    def fsync(self) -> None:
        if self._fd is not None:
            sync_data(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            sync_data(self._fd)
            os.close(self._fd)
            self._fd = None


def _slot_key(slot: bytes) -> BucketKey | None:
    try:
        tally = BucketTally.decode(slot)
    except CorruptRecord:
        return None
    return None if tally is None else tally.key
