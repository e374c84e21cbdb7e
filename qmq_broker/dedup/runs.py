"""Run files: immutable, sorted (id hash, seq) tables of one subject's dedup store.

A run named ``<first_seq:020d>-<end_seq:020d>.run`` holds the ids added for seqs
``[first_seq, end_seq)`` that were not expired when it was written. Layout, little-endian::

    0   8s  magic b"QMQDEDUP"
    8   u16 format version (1)
    10  u16 reserved, 0
    12  u32 reserved, 0
    16  u64 count, entries
    24  u64 first_seq
    32  u64 end_seq
    40  u64 min_seq, the lowest seq among the entries (first_seq <= min_seq < end_seq)
    48  u32 CRC-32 of the hashes column
    52  u32 CRC-32 of the seqs column
    56  4x  reserved, 0
    60  u32 CRC-32 of bytes 0..60 of the header
    64  count x u64 id hashes, ascending (equal hashes may repeat)
    ..  count x u64 seqs, in the order of the hashes

The header checks itself (magic, version, its CRC, its fields against the file's name and
size), so opening a store reads headers only; ``verify_run`` checks a body. Runs are
written under ``<name>.tmp``, fsynced, renamed and the directory fsynced: a crash leaves
either the whole run or a temporary file that opening deletes. Lookups memory-map a run
and binary-search its hashes; nothing reads a whole run into memory (merging goes through
the hash space in slices of ``CHUNK_IDS`` entries).
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from qmq_broker.errors import CorruptRecord
from qmq_broker.storage.fsync import sync_all, sync_dir

RUN_MAGIC = b"QMQDEDUP"
RUN_VERSION = 1
RUN_SUFFIX = ".run"
TEMP_SUFFIX = ".tmp"
RUN_HEADER = struct.Struct("<8sHHIQQQQII4xI")
RUN_HEADER_SIZE = RUN_HEADER.size  # 64
ENTRY_SIZE = 16  # a hash and a seq
CHUNK_IDS = 1 << 20  # entries handled at once when merging, counting or verifying
_HEADER_CRC_AT = RUN_HEADER_SIZE - 4
_RUN_NAME = re.compile(r"^(\d{20})-(\d{20})\.run$")
U64: np.dtype[np.uint64] = np.dtype(np.uint64).newbyteorder("<")


def run_name(first_seq: int, end_seq: int) -> str:
    return f"{first_seq:020d}-{end_seq:020d}{RUN_SUFFIX}"


def parse_run_name(name: str) -> tuple[int, int] | None:
    """``(first_seq, end_seq)`` of a run file's name, None for any other name."""
    matched = _RUN_NAME.match(name)
    if matched is None:
        return None
    return int(matched.group(1)), int(matched.group(2))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunHeader:
    count: int
    first_seq: int
    end_seq: int
    min_seq: int
    hashes_crc: int
    seqs_crc: int

    @property
    def name(self) -> str:
        return run_name(self.first_seq, self.end_seq)

    @property
    def file_size(self) -> int:
        return RUN_HEADER_SIZE + ENTRY_SIZE * self.count

    def covers(self, other: RunHeader) -> bool:
        """This run's seq range holds all of ``other``'s (a merge's input left by a crash)."""
        return self.first_seq <= other.first_seq and other.end_seq <= self.end_seq

    def live_estimate(self, horizon: int) -> int:
        """Entries with seq >= ``horizon``, assuming seqs spread evenly over the range."""
        if horizon <= self.min_seq:
            return self.count
        if horizon >= self.end_seq:
            return 0
        return self.count * (self.end_seq - horizon) // (self.end_seq - self.min_seq)

    def encode(self) -> bytes:
        fields = (
            RUN_MAGIC,
            RUN_VERSION,
            0,
            0,
            self.count,
            self.first_seq,
            self.end_seq,
            self.min_seq,
            self.hashes_crc,
            self.seqs_crc,
        )
        head = RUN_HEADER.pack(*fields, 0)[:_HEADER_CRC_AT]
        return head + struct.pack("<I", zlib.crc32(head))

    @classmethod
    def decode(cls, data: bytes, *, path: str) -> RunHeader:
        """Check a header on its own; ``read_run_header`` also checks it against its file."""

        def damaged(reason: str) -> CorruptRecord:
            return CorruptRecord(path=path, offset=0, reason=reason)

        if len(data) < RUN_HEADER_SIZE:
            raise damaged("run header cut short")
        fields = RUN_HEADER.unpack_from(data, 0)
        magic, version, _, _, count, first, end, min_seq, hashes_crc, seqs_crc, crc = fields
        if magic != RUN_MAGIC:
            raise damaged("not a dedup run (bad magic)")
        if zlib.crc32(data[:_HEADER_CRC_AT]) != crc:
            raise damaged("run header CRC mismatch")
        if version != RUN_VERSION:
            raise damaged(f"unsupported run version {version}")
        if count == 0 or not first <= min_seq < end:
            raise damaged(f"inconsistent header: {count} ids, seqs {first}..{min_seq}..{end}")
        return cls(
            count=count,
            first_seq=first,
            end_seq=end,
            min_seq=min_seq,
            hashes_crc=hashes_crc,
            seqs_crc=seqs_crc,
        )


def read_run_header(path: Path) -> RunHeader:
    """A run's header, checked against the file's name and size (its body is not read)."""
    with open(path, "rb") as handle:
        data = handle.read(RUN_HEADER_SIZE)
        size = os.fstat(handle.fileno()).st_size
    header = RunHeader.decode(data, path=str(path))
    if header.name != path.name:
        raise CorruptRecord(path=str(path), offset=0, reason=f"header says {header.name}")
    if header.file_size != size:
        raise CorruptRecord(
            path=str(path), offset=0, reason=f"{size} bytes, header says {header.file_size}"
        )
    return header


class MappedRun:
    """A run file mapped read-only; unmapped when the last reference to it goes."""

    __slots__ = ("_mapped", "hashes", "header", "path", "seqs")

    def __init__(self, path: Path, header: RunHeader) -> None:
        self.path = path
        self.header = header
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._mapped = mapped
        count = header.count
        self.hashes: NDArray[np.uint64] = np.frombuffer(
            mapped, dtype=U64, count=count, offset=RUN_HEADER_SIZE
        )
        self.seqs: NDArray[np.uint64] = np.frombuffer(
            mapped, dtype=U64, count=count, offset=RUN_HEADER_SIZE + 8 * count
        )

    def release_pages(self) -> None:
        """Drop the pages lookups and scans brought in from this process's memory (they
        stay in the OS page cache while it has room): a run costs the broker no RAM."""
        self._mapped.madvise(mmap.MADV_DONTNEED)

    def find(self, key: np.uint64) -> int | None:
        """The largest seq stored under hash ``key``, None when the run does not hold it."""
        hashes = self.hashes
        low = int(hashes.searchsorted(key))
        if low == len(hashes) or hashes[low] != key:
            return None
        if low + 1 == len(hashes) or hashes[low + 1] != key:
            return int(self.seqs[low])
        high = int(hashes.searchsorted(key, side="right"))
        return int(self.seqs[low:high].max())

    def slices(self) -> Iterator[slice]:
        for start in range(0, self.header.count, CHUNK_IDS):
            yield slice(start, min(start + CHUNK_IDS, self.header.count))

    def live_count(self, horizon: int) -> int:
        """Entries with seq >= ``horizon`` (reads the seqs column unless all or none are)."""
        if horizon <= self.header.min_seq:
            return self.header.count
        if horizon >= self.header.end_seq:
            return 0
        floor = np.uint64(horizon)
        return sum(int(np.count_nonzero(self.seqs[part] >= floor)) for part in self.slices())

    def live_hashes(self, horizon: int) -> Iterator[NDArray[np.uint64]]:
        """The hashes of entries with seq >= ``horizon``, a slice at a time."""
        if horizon >= self.header.end_seq:
            return
        floor = np.uint64(horizon)
        whole = horizon <= self.header.min_seq
        for part in self.slices():
            hashes = self.hashes[part]
            yield hashes if whole else hashes[self.seqs[part] >= floor]


class RunWriter:
    """Writes one run under a temporary name, both columns a chunk at a time.

    ``count`` must be known up front (the seqs column starts after the hashes). Used as a
    context manager: ``finish()`` makes the run durable under its name; leaving the block
    without it removes the temporary file.
    """

    def __init__(self, directory: Path, *, count: int, first_seq: int, end_seq: int) -> None:
        self.path = directory / run_name(first_seq, end_seq)
        self._temp = self.path.with_name(self.path.name + TEMP_SUFFIX)
        self._count = count
        self._first_seq = first_seq
        self._end_seq = end_seq
        self._written = 0
        self._min_seq = end_seq
        self._hashes_crc = 0
        self._seqs_crc = 0
        self._fd: int | None = os.open(self._temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._temp.unlink(missing_ok=True)

    def append(self, hashes: NDArray[np.uint64], seqs: NDArray[np.uint64]) -> None:
        """The next entries, sorted by hash and all above the previous ones' hashes."""
        if len(hashes) == 0:
            return
        hashes = np.ascontiguousarray(hashes, dtype=U64)
        seqs = np.ascontiguousarray(seqs, dtype=U64)
        at = self._written
        self._pwrite(hashes.data, RUN_HEADER_SIZE + 8 * at)
        self._pwrite(seqs.data, RUN_HEADER_SIZE + 8 * (self._count + at))
        self._hashes_crc = zlib.crc32(hashes.data, self._hashes_crc)
        self._seqs_crc = zlib.crc32(seqs.data, self._seqs_crc)
        self._min_seq = min(self._min_seq, int(seqs.min()))
        self._written += len(hashes)

    def finish(self) -> RunHeader:
        if self._written != self._count or self._fd is None:
            raise ValueError(f"{self._written} entries written, {self._count} announced")
        header = RunHeader(
            count=self._count,
            first_seq=self._first_seq,
            end_seq=self._end_seq,
            min_seq=self._min_seq,
            hashes_crc=self._hashes_crc,
            seqs_crc=self._seqs_crc,
        )
        self._pwrite(header.encode(), 0)
        fd, self._fd = self._fd, None
        try:
            sync_all(fd)
        finally:
            os.close(fd)
        os.replace(self._temp, self.path)
        sync_dir(self.path.parent)
        return header

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        assert self._fd is not None
        view = memoryview(data).cast("B")
        while view:
            done = os.pwrite(self._fd, view, offset)
            view = view[done:]
            offset += done


def write_run(
    directory: Path, hashes: NDArray[np.uint64], seqs: NDArray[np.uint64]
) -> RunHeader | None:
    """A run of the given (unsorted) entries, seqs ``[min, max + 1)``; None when empty."""
    if len(hashes) == 0:
        return None
    order = np.argsort(hashes, kind="stable")
    first, end = int(seqs.min()), int(seqs.max()) + 1
    with RunWriter(directory, count=len(hashes), first_seq=first, end_seq=end) as writer:
        writer.append(hashes[order], seqs[order])
        return writer.finish()


def merge_runs(directory: Path, inputs: Sequence[MappedRun], *, horizon: int) -> RunHeader | None:
    """One run of the inputs' entries with seq >= ``horizon``; None when none are left.

    The inputs are adjacent runs in seq order; the merged run's range spans all of theirs,
    so a crash before they are deleted leaves them wholly covered by it. Goes through the
    hash space in slices of about ``CHUNK_IDS`` entries (hashes are uniform), so memory
    stays bounded whatever the runs' sizes.
    """
    count = sum(run.live_count(horizon) for run in inputs)
    if count == 0:
        return None
    first = min(run.header.first_seq for run in inputs)
    end = max(run.header.end_seq for run in inputs)
    parts = -(-sum(run.header.count for run in inputs) // CHUNK_IDS)
    bounds = [0, *((index << 64) // parts for index in range(1, parts)), 1 << 64]
    floor = np.uint64(horizon)
    with RunWriter(directory, count=count, first_seq=first, end_seq=end) as writer:
        for low, high in itertools.pairwise(bounds):
            hashes: list[NDArray[np.uint64]] = []
            seqs: list[NDArray[np.uint64]] = []
            for run in inputs:
                start = _bound(run.hashes, low)
                stop = _bound(run.hashes, high)
                part_seqs = run.seqs[start:stop]
                keep = part_seqs >= floor
                hashes.append(run.hashes[start:stop][keep])
                seqs.append(part_seqs[keep])
            merged_hashes = np.concatenate(hashes)
            order = np.argsort(merged_hashes, kind="stable")
            writer.append(merged_hashes[order], np.concatenate(seqs)[order])
        return writer.finish()


def _bound(hashes: NDArray[np.uint64], value: int) -> int:
    if value == 0:
        return 0
    if value == 1 << 64:
        return len(hashes)
    return int(hashes.searchsorted(np.uint64(value)))


def verify_run(run: MappedRun) -> list[str]:
    """What is wrong with a run's body: CRCs, hash order, seqs outside the header's range."""
    header = run.header
    problems: list[str] = []
    hashes_crc = seqs_crc = 0
    lowest = header.end_seq
    previous: np.uint64 | None = None
    unsorted = False
    out_of_range = 0
    for part in run.slices():
        hashes = run.hashes[part]
        seqs = run.seqs[part]
        hashes_crc = zlib.crc32(np.ascontiguousarray(hashes).data, hashes_crc)
        seqs_crc = zlib.crc32(np.ascontiguousarray(seqs).data, seqs_crc)
        if (previous is not None and hashes[0] < previous) or bool(
            np.any(hashes[1:] < hashes[:-1])
        ):
            unsorted = True
        previous = hashes[-1]
        out_of_range += int(
            np.count_nonzero(
                (seqs < np.uint64(header.first_seq)) | (seqs >= np.uint64(header.end_seq))
            )
        )
        lowest = min(lowest, int(seqs.min()))
    if hashes_crc != header.hashes_crc:
        problems.append(f"{run.path}: hashes CRC mismatch")
    if seqs_crc != header.seqs_crc:
        problems.append(f"{run.path}: seqs CRC mismatch")
    if unsorted:
        problems.append(f"{run.path}: hashes out of order")
    if out_of_range:
        problems.append(f"{run.path}: {out_of_range} seqs outside the run's range")
    elif lowest != header.min_seq:
        problems.append(f"{run.path}: lowest seq {lowest}, header says {header.min_seq}")
    return problems
