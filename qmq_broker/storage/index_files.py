"""Subject index files: a subject's index entries in fixed chunks of seqs, one file each.

A chunk file is ``INDEX_HEADER`` then up to ``INDEX_CHUNK_ENTRIES`` packed ``INDEX_ENTRY``
records, entry ``i`` for seq ``start + i``. The journal's writer thread appends to the
newest chunk of each subject and seals a chunk when it fills (its CRC-32 goes into the
header, then it is fsynced), so every chunk but a subject's newest is immutable and
self-checking. Retention deletes a chunk once every message it points to is gone. The
broker reads chunks with ``pread`` (``ChunkReader``): the OS page cache caches them, not
the broker's heap.
"""

from __future__ import annotations

import collections
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qmq_broker.errors import StorageError
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_VERSION,
    chunk_start,
    index_chunk_path,
    index_header,
)
from qmq_broker.storage.fsync import rewrite_file, sync_dir

CHUNK_BYTES = INDEX_CHUNK_ENTRIES * INDEX_ENTRY_SIZE
_READ_BLOCK = 128  # entries read at once for live reads (4 KiB): pulls read runs of seqs


@dataclass(frozen=True, slots=True)
class ChunkFile:
    """A chunk file's entries as read, and its header's seal (0: not sealed)."""

    entries: bytes
    sealed_crc: int

    @property
    def full(self) -> bool:
        return len(self.entries) == CHUNK_BYTES

    def seal_matches(self) -> bool:
        """Whether a full chunk's entries still match the CRC it was sealed with.

        A full chunk with no seal (a crash between the last write and the seal) is taken as
        it is: its entries past the checkpoint are checked against the log by recovery.
        """
        return not self.sealed_crc or zlib.crc32(self.entries) == self.sealed_crc


def read_chunk(path: Path) -> ChunkFile | None:
    """A chunk's whole entries, or ``None`` when its header is not an index header."""
    data = path.read_bytes()
    if len(data) < INDEX_HEADER.size:
        return None
    magic, version, entry_size, sealed_crc = INDEX_HEADER.unpack_from(data)
    if magic != INDEX_MAGIC or version != INDEX_VERSION or entry_size != INDEX_ENTRY_SIZE:
        return None
    count = min((len(data) - INDEX_HEADER.size) // INDEX_ENTRY_SIZE, INDEX_CHUNK_ENTRIES)
    return ChunkFile(
        data[INDEX_HEADER.size : INDEX_HEADER.size + count * INDEX_ENTRY_SIZE], sealed_crc
    )


def write_chunk(data_dir: Path, subject: str, start: int, entries: bytes | bytearray) -> None:
    """Write a chunk anew and durably (recovery, repair, migration), sealed if full."""
    path = index_chunk_path(data_dir, subject, start)
    created = not path.parent.is_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    if created:
        sync_dir(path.parent.parent)
    sealed = zlib.crc32(entries) if len(entries) == CHUNK_BYTES else 0
    rewrite_file(path, index_header(sealed), entries)
    sync_dir(path.parent)


def remove_chunk(data_dir: Path, subject: str, start: int) -> None:
    index_chunk_path(data_dir, subject, start).unlink(missing_ok=True)


ChunkRepair = Callable[[str, int], object]  # (subject, chunk start): rewrite it from the log


class ChunkReader:
    """Reads sealed index entries of every subject with ``pread``, a few descriptors cached.

    Keeps the last block read per subject, so a pull walking a run of old seqs costs one
    ``pread`` per 128 entries. The first time a chunk is opened its seal is checked (one
    read of the chunk per process); a chunk that fails is handed to ``repair`` first.
    """

    def __init__(
        self, data_dir: Path, *, repair: ChunkRepair | None = None, max_open: int = 64
    ) -> None:
        self._data_dir = data_dir
        self._repair = repair
        self._max_open = max_open
        self._checked: set[tuple[str, int]] = set()
        self._fds: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        self._blocks: dict[str, tuple[int, bytes]] = {}  # subject -> (first seq, entries)
        self._lock = threading.Lock()

    def entry(self, subject: str, seq: int) -> bytes:
        """The packed entry of ``seq``; ``StorageError`` if its chunk is gone or short."""
        first, data = self.block(subject, seq)
        at = (seq - first) * INDEX_ENTRY_SIZE
        return data[at : at + INDEX_ENTRY_SIZE]

    def block(self, subject: str, seq: int) -> tuple[int, bytes]:
        """``(first seq, packed entries)`` of a block that holds ``seq`` (the subject's last
        one when it does); ``StorageError`` if its chunk is gone or short."""
        block = self._blocks.get(subject)
        if block is not None and 0 <= seq - block[0] < len(block[1]) // INDEX_ENTRY_SIZE:
            return block
        start = chunk_start(seq)
        first = seq - seq % _READ_BLOCK
        # format.index.entry_offset(first), inline: this read serves pulls
        data = os.pread(
            self._fd(subject, start),
            _READ_BLOCK * INDEX_ENTRY_SIZE,
            INDEX_HEADER.size + (first - start) * INDEX_ENTRY_SIZE,
        )
        if len(data) < (seq - first + 1) * INDEX_ENTRY_SIZE:
            raise StorageError(f"index of {subject}: seq {seq} is past its chunk's end")
        block = self._blocks[subject] = (first, data)
        return block

    def _fd(self, subject: str, start: int) -> int:
        key = (subject, start)
        with self._lock:
            fd = self._fds.get(key)
            if fd is not None:
                self._fds.move_to_end(key)
                return fd
            path = index_chunk_path(self._data_dir, subject, start)
            if key not in self._checked:
                self._check(subject, start, path)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise StorageError(f"index chunk {path} is gone (retention)") from exc
            self._fds[key] = fd
            while len(self._fds) > self._max_open:
                _, oldest = self._fds.popitem(last=False)
                os.close(oldest)
            return fd

    def _check(self, subject: str, start: int, path: Path) -> None:
        try:
            found = read_chunk(path)
        except FileNotFoundError as exc:
            raise StorageError(f"index chunk {path} is gone (retention)") from exc
        if found is None or not found.full or not found.seal_matches():
            if self._repair is None:
                raise StorageError(f"index chunk {path} does not match its seal")
            self._repair(subject, start)
        self._checked.add((subject, start))

    def forget(self, subject: str, start: int) -> None:
        """A chunk is about to be deleted or rewritten: drop what is cached of it."""
        with self._lock:
            fd = self._fds.pop((subject, start), None)
            self._checked.discard((subject, start))
            block = self._blocks.get(subject)
            if block is not None and start <= block[0] < start + INDEX_CHUNK_ENTRIES:
                del self._blocks[subject]
        if fd is not None:
            os.close(fd)

    @property
    def open_files(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, collections.OrderedDict()
            self._blocks.clear()
        for fd in fds.values():
            os.close(fd)
