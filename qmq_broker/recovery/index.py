"""Subject indexes during recovery: check the chunk files, hold only the tail in memory.

Recovery works on each subject's index as a ``WorkingIndex``. The chunks before ``base``
stay on disk, sealed; their CRCs are checked when the broker first reads each one
(``ChunkReader``), not here, so start-up does not read the history. The entries from
``base`` on (the chunks that point into the log segments recovery scans, and the newest,
unsealed chunk) are held in memory, corrected and extended there, and written back by
``save``. ``base`` is a chunk start, so what recovery holds in memory is bounded by what
the checkpoint did not cover (rounded out to chunks), not by the subject's history.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    chunk_start,
    entry_offset,
    index_chunk_path,
    index_dir,
    list_index_chunks,
    list_indexed_subjects,
)
from qmq_broker.recovery.index_repair import rebuild_chunk
from qmq_broker.storage.checkpoint import IndexDigest
from qmq_broker.storage.index_files import CHUNK_BYTES, read_chunk, remove_chunk, write_chunk

Entry = tuple[int, int, int, int, int]  # segment, length, offset, stored_us, id hash


@dataclasses.dataclass(slots=True)
class WorkingIndex:
    """A subject's index while recovery runs: chunks on disk below ``base``, entries in
    memory from it."""

    data_dir: Path
    name: str
    base: int = 0
    entries: bytearray = dataclasses.field(default_factory=bytearray)
    first_chunk: int = 0  # the oldest chunk on disk (retention removed those before it)
    rebuilt: bool = False  # emptied: every chunk file is written anew from ``entries``
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return self.base + len(self.entries) // INDEX_ENTRY_SIZE

    def entry(self, seq: int) -> Entry:
        if seq >= self.base:
            found: Entry = INDEX_ENTRY.unpack_from(
                self.entries, (seq - self.base) * INDEX_ENTRY_SIZE
            )
            return found
        start = chunk_start(seq)
        path = index_chunk_path(self.data_dir, self.name, start)
        with open(path, "rb") as handle:
            handle.seek(entry_offset(seq))
            raw = handle.read(INDEX_ENTRY_SIZE)
        unpacked: Entry = INDEX_ENTRY.unpack(raw)
        return unpacked

    def hold_from(self, seq: int) -> None:
        """Bring the chunks from ``chunk_start(seq)`` to ``base`` into memory."""
        start = max(chunk_start(seq), self.first_chunk)
        if start >= self.base:
            return
        loaded = bytearray()
        for chunk in range(start, self.base, INDEX_CHUNK_ENTRIES):
            path = index_chunk_path(self.data_dir, self.name, chunk)
            found = read_chunk(path)
            if found is None or not found.seal_matches():  # read anyway: check it now
                rebuild_chunk(self.data_dir, self.name, chunk)
                self.problems.append(f"{path}: failed its CRC; rebuilt from the log")
                found = read_chunk(path)
            loaded += found.entries if found is not None else b""
        self.entries[:0] = loaded
        self.base = start

    def set(self, seq: int, packed: bytes) -> bool:
        """Overwrite the entry of ``seq``; whether it changed."""
        if seq < self.base:
            self.hold_from(seq)
        at = (seq - self.base) * INDEX_ENTRY_SIZE
        if self.entries[at : at + INDEX_ENTRY_SIZE] == packed:
            return False
        self.entries[at : at + INDEX_ENTRY_SIZE] = packed
        return True

    def truncate(self, count: int) -> None:
        if count < self.base:
            self.hold_from(count)
        del self.entries[(count - self.base) * INDEX_ENTRY_SIZE :]

    def first_seq_where(self, low: int, predicate: Callable[[Entry], bool]) -> int:
        """The first seq in ``[low, count)`` whose entry satisfies a predicate that, once
        true, stays true for later seqs (``count`` if none)."""
        high = self.count
        while low < high:
            mid = (low + high) // 2
            if predicate(self.entry(mid)):
                high = mid
            else:
                low = mid + 1
        return low

    def entries_between(self, start: int, end: int) -> Iterator[tuple[int, Entry]]:
        """``(seq, entry)`` for seqs ``[start, end)``, read a chunk at a time."""
        seq = start
        while seq < end:
            chunk = chunk_start(seq)
            stop = min(end, chunk + INDEX_CHUNK_ENTRIES)
            if chunk >= self.base:
                data: bytes | bytearray = self.entries
                first = self.base
            else:
                found = read_chunk(index_chunk_path(self.data_dir, self.name, chunk))
                data = found.entries if found is not None else b""
                first = chunk
            view = memoryview(data)[
                (seq - first) * INDEX_ENTRY_SIZE : (stop - first) * INDEX_ENTRY_SIZE
            ]
            yield from enumerate(INDEX_ENTRY.iter_unpack(view), start=seq)
            view.release()
            seq = stop

    def lengths(self, start: int, end: int) -> int:
        """The stored bytes of seqs ``[start, end)``."""
        return sum(entry[1] for _, entry in self.entries_between(start, end))

    def save(self) -> list[int]:
        """Write back the chunks from ``base`` that differ from their files (all of them
        when rebuilt), and remove files past the end; returns the chunks written."""
        written = []
        if self.rebuilt:
            for start in list_index_chunks(self.data_dir, self.name):
                remove_chunk(self.data_dir, self.name, start)
        count = self.count
        for start in range(self.base, count, INDEX_CHUNK_ENTRIES):
            at = (start - self.base) * INDEX_ENTRY_SIZE
            wanted = self.entries[at : at + CHUNK_BYTES]
            path = index_chunk_path(self.data_dir, self.name, start)
            found = None if self.rebuilt or not path.exists() else read_chunk(path)
            sealed_right = len(wanted) < CHUNK_BYTES or (
                found is not None and found.sealed_crc == zlib.crc32(wanted)
            )
            if found is None or found.entries != wanted or not sealed_right:
                write_chunk(self.data_dir, self.name, start, wanted)
                written.append(start)
        for start in list_index_chunks(self.data_dir, self.name):
            if start >= count:
                remove_chunk(self.data_dir, self.name, start)
        return written


@dataclasses.dataclass(slots=True)
class LoadedIndexes:
    indexes: dict[str, WorkingIndex]
    rebuild: set[str]  # damaged: rebuilt from the whole log


def load_indexes(
    data_dir: Path,
    digests: dict[str, IndexDigest],
    *,
    hold_from_segment: int,
    problems: list[str],
) -> LoadedIndexes:
    """Every subject's index, checked: sealed chunks by their size, the newest one against
    the checkpoint's digest. A subject whose chunks do not check out (a bad header or CRC,
    a missing chunk, fewer entries than the checkpoint covered) is emptied for a rebuild
    from the log. Entries pointing into segments from ``hold_from_segment`` on (the ones
    recovery scans) are held in memory."""
    indexes: dict[str, WorkingIndex] = {}
    rebuild: set[str] = set()
    for name in list_indexed_subjects(data_dir):
        index = WorkingIndex(data_dir=data_dir, name=name, problems=problems)
        damage = _check_chunks(index, digests.get(name))
        if damage is not None:
            problems.append(f"{index_dir(data_dir, name)}: {damage}; rebuilt from the log")
            index = WorkingIndex(data_dir=data_dir, name=name, rebuilt=True, problems=problems)
            rebuild.add(name)
        else:
            hold = index.first_seq_where(
                index.first_chunk, lambda entry: entry[0] >= hold_from_segment
            )
            if name in digests:
                hold = min(hold, digests[name].count)
            index.hold_from(hold)
        indexes[name] = index
    for name, digest in digests.items():
        if name not in indexes and digest.count > 0:  # every chunk gone
            problems.append(f"index of {name}: missing; rebuilt from the log")
            indexes[name] = WorkingIndex(data_dir=data_dir, name=name, rebuilt=True)
            rebuild.add(name)
    return LoadedIndexes(indexes, rebuild)


def _check_chunks(index: WorkingIndex, digest: IndexDigest | None) -> str | None:
    """What is wrong with a subject's chunk files, or ``None``; on success ``index`` is
    positioned past its newest chunk's entries with ``base`` at that chunk (in memory)."""
    starts = list_index_chunks(index.data_dir, index.name)
    if not starts:
        return None if digest is None or digest.count == 0 else "no index chunk left"
    if starts[0] % INDEX_CHUNK_ENTRIES:
        return f"chunk {starts[0]} does not start at a chunk edge"
    expected = list(range(starts[0], starts[-1] + 1, INDEX_CHUNK_ENTRIES))
    if starts != expected:
        return f"chunk(s) {sorted(set(expected) - set(starts))} missing between others"
    index.first_chunk = starts[0]
    for start in starts[:-1]:  # sealed: their CRCs are checked when the broker first reads them
        path = index_chunk_path(index.data_dir, index.name, start)
        if path.stat().st_size != INDEX_HEADER.size + CHUNK_BYTES:
            return f"chunk {start}: cut short before newer chunks"
    newest = read_chunk(index_chunk_path(index.data_dir, index.name, starts[-1]))
    if newest is None:
        return f"chunk {starts[-1]}: unreadable header"
    if not newest.seal_matches():
        return f"chunk {starts[-1]}: does not match the CRC it was sealed with"
    index.base = starts[-1]
    index.entries = bytearray(newest.entries)
    if digest is not None and not _matches(index, digest):
        return "does not match the checkpoint"
    return None


def _matches(index: WorkingIndex, digest: IndexDigest) -> bool:
    """Whether the entries the checkpoint covered are still there and, in the chunk that
    was newest then, still the same."""
    if index.count < digest.count:
        return False
    start = chunk_start(digest.count)
    if start == digest.count:
        return True  # the checkpoint fell on a chunk edge: sealed chunks speak for themselves
    if start >= index.base:
        at = (start - index.base) * INDEX_ENTRY_SIZE
        covered = memoryview(index.entries)[at : at + (digest.count - start) * INDEX_ENTRY_SIZE]
        matches = zlib.crc32(covered) == digest.crc
        covered.release()
        return matches
    found = read_chunk(index_chunk_path(index.data_dir, index.name, start))
    if found is None:
        return False
    return zlib.crc32(found.entries[: (digest.count - start) * INDEX_ENTRY_SIZE]) == digest.crc
