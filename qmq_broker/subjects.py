"""Subjects: each one's index, visible end, dedup store and counters.

``SubjectTable`` is the only code that changes a subject. It keeps the invariants
``first_seq <= end_seq <= next_seq``: ``next_seq`` counts allocated messages, ``end_seq`` the
ones durable and visible to pulls, ``first_seq`` the oldest that retention has not deleted.
Everyone else reads a ``SubjectLog`` through its properties.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

from qmq_broker.dedup import DedupStats, DedupStore
from qmq_broker.format.index import INDEX_CHUNK_ENTRIES, INDEX_ENTRY, INDEX_ENTRY_SIZE, chunk_start
from qmq_broker.storage.checkpoint import IndexDigest
from qmq_broker.storage.index_files import CHUNK_BYTES, ChunkReader
from qmq_wire.rules import Position


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SubjectStats:
    subject: str
    messages: int
    bytes: int
    first_seq: int
    next_seq: int  # the visible end: the seq the next stored message will get


def window_start(first_seq: int, horizon: int) -> int:
    """The seq the dedup window starts at, given the first retained seq stored inside it.

    Ids of messages retention removed have no stored time left to compare: while the first
    retained message is inside the window they may be too, so the window keeps them (0).
    """
    return horizon if horizon > first_seq else 0


class SubjectLog:
    """One subject's counters and index.

    Only the newest index chunk's entries are held in memory (at most
    ``INDEX_CHUNK_ENTRIES``), and the chunk that filled before it until all of it is
    visible; older entries are read from their chunk files. The journal writes a batch's
    index entries, and seals a chunk it fills, before the batch becomes visible, so a
    chunk read from its file is whole and sealed: reads never race the writer.
    """

    __slots__ = (
        "_bytes",
        "_crc",
        "_crc_end",
        "_dedup",
        "_end_seq",
        "_filled",
        "_first_seq",
        "_open",
        "_open_start",
        "_reader",
        "name",
    )

    def __init__(
        self,
        name: str,
        reader: ChunkReader,
        dedup: DedupStore | None,
        *,
        open_start: int = 0,
        open_entries: bytearray | None = None,
    ) -> None:
        self.name = name
        self._reader = reader
        self._open_start = open_start
        self._open = open_entries if open_entries is not None else bytearray()
        # The chunk that filled last, until all of it is visible (so written and sealed):
        # reads of it must not reach a file the writer may still be finishing.
        self._filled: bytes | None = None
        self._first_seq = 0
        self._end_seq = self.next_seq
        self._dedup = dedup  # None: a subject known only to delayed messages so far
        self._bytes = 0
        self._crc = zlib.crc32(self._open)  # of the newest chunk's entries up to _crc_end
        self._crc_end = len(self._open)  # appends leave the CRC to the next checkpoint

    @property
    def first_seq(self) -> int:
        return self._first_seq

    @property
    def end_seq(self) -> int:
        return self._end_seq

    @property
    def next_seq(self) -> int:
        return self._open_start + len(self._open) // INDEX_ENTRY_SIZE

    def raw(self, seq: int) -> tuple[int, int, int, int, int]:
        """(segment, length, offset, stored_us, id_hash) of a seq, without an object."""
        values: tuple[int, int, int, int, int]
        if seq >= self._open_start:
            values = INDEX_ENTRY.unpack_from(
                self._open, (seq - self._open_start) * INDEX_ENTRY_SIZE
            )
        elif self._filled is not None and seq >= self._open_start - INDEX_CHUNK_ENTRIES:
            at = seq - self._open_start + INDEX_CHUNK_ENTRIES
            values = INDEX_ENTRY.unpack_from(self._filled, at * INDEX_ENTRY_SIZE)
        else:
            values = INDEX_ENTRY.unpack(self._reader.entry(self.name, seq))
        return values

    def positions(self, seqs: list[int]) -> list[tuple[int, int, int]]:
        """``(segment, offset, length)`` of each seq: ``raw`` for the run of seqs a pull
        reads, each sealed block looked up once."""
        unpack = INDEX_ENTRY.unpack_from
        open_start = self._open_start
        filled_start = open_start - INDEX_CHUNK_ENTRIES if self._filled is not None else open_start
        block_first = block_end = -1
        block = b""
        out = []
        for seq in seqs:
            if seq >= open_start:
                segment, length, offset, _, _ = unpack(
                    self._open, (seq - open_start) * INDEX_ENTRY_SIZE
                )
            elif seq >= filled_start:
                assert self._filled is not None
                at = (seq - filled_start) * INDEX_ENTRY_SIZE
                segment, length, offset, _, _ = unpack(self._filled, at)
            else:
                if not block_first <= seq < block_end:
                    block_first, block = self._reader.block(self.name, seq)
                    block_end = block_first + len(block) // INDEX_ENTRY_SIZE
                at = (seq - block_first) * INDEX_ENTRY_SIZE
                segment, length, offset, _, _ = unpack(block, at)
            out.append((segment, offset, length))
        return out

    def dedup_stats(self) -> DedupStats | None:
        return None if self._dedup is None else self._dedup.stats()

    def seq_of(self, hashed_id: int) -> int | None:
        """The seq stored under an id hash within the dedup window, if any (the hash's: the
        caller confirms it against the stored id)."""
        return None if self._dedup is None else self._dedup.find(hashed_id)

    def seqs_of(self, hashed_ids: list[int]) -> list[int | None]:
        """``seq_of`` of each id hash (one filter query for the lot)."""
        if self._dedup is None:
            return [None] * len(hashed_ids)
        return self._dedup.find_many(hashed_ids)

    def first_stored_at_or_after(self, stored_us: int) -> int:
        """The first visible seq stored at or after ``stored_us`` (``end_seq`` if none):
        stored times grow with seqs, so a binary search (a few reads of old chunks)."""
        low, high = self._first_seq, self._end_seq
        while low < high:
            mid = (low + high) // 2
            if self.raw(mid)[3] < stored_us:
                low = mid + 1
            else:
                high = mid
        return low

    def seq_at(self, position: Position) -> int:
        """The seq a group at ``position`` reads next: a seq or time before the first
        retained message means the first retained, past the end means the end (latest)."""
        if position.kind == "earliest":
            return self._first_seq
        if position.kind == "latest":
            return self._end_seq
        if position.kind == "time":
            return self.first_stored_at_or_after(position.value)
        return min(max(position.value, self._first_seq), self._end_seq)

    def stats(self) -> SubjectStats:
        return SubjectStats(
            subject=self.name,
            messages=max(self._end_seq - self._first_seq, 0),
            bytes=self._bytes,
            first_seq=self._first_seq,
            next_seq=self._end_seq,
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RecoveredSubject:
    """What recovery hands over for one subject: its newest chunk's entries and counters."""

    name: str
    open_start: int
    open_entries: bytearray
    first_seq: int
    bytes: int
    dedup: DedupStore  # opened, with the ids of the index tail its runs lack added


class SubjectTable(Mapping[str, SubjectLog]):
    """Every subject of the broker by name; the one writer of their fields."""

    def __init__(self, reader: ChunkReader, *, dedup_dir: Path, dedup_flush_at: int) -> None:
        self._subjects: dict[str, SubjectLog] = {}
        self.reader = reader
        self._dedup_dir = dedup_dir
        self._dedup_flush_at = dedup_flush_at
        self.appended = 0  # messages appended since start (checkpoints count them)

    def _new(self, name: str) -> SubjectLog:
        store = DedupStore.open(self._dedup_dir / name, flush_at=self._dedup_flush_at)
        subject = self._subjects[name] = SubjectLog(name, self.reader, store)
        return subject

    # --- reading ---------------------------------------------------------------------------

    def __getitem__(self, name: str) -> SubjectLog:
        return self._subjects[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._subjects)

    def __len__(self) -> int:
        return len(self._subjects)

    def messages(self) -> int:
        return sum(s.end_seq - s.first_seq for s in self._subjects.values())

    def index_digests(self) -> dict[str, IndexDigest]:
        """Per subject, for checkpoints: how many index entries, the CRC-32 of those in the
        newest chunk, and the first seq and stored bytes then."""
        for subject in self._subjects.values():
            end = len(subject._open)
            if subject._crc_end < end:  # entries appended since the last digest
                subject._crc = zlib.crc32(subject._open[subject._crc_end : end], subject._crc)
                subject._crc_end = end
        return {
            name: IndexDigest(count=s.next_seq, crc=s._crc, first_seq=s._first_seq, bytes=s._bytes)
            for name, s in self._subjects.items()
        }

    def memory_bytes(self) -> int:
        """Bytes of index entries held in memory (the newest chunk of each subject)."""
        return sum(
            len(s._open) + (len(s._filled) if s._filled is not None else 0)
            for s in self._subjects.values()
        )

    def find(self, name: str) -> SubjectLog | None:
        """The subject, if anything was stored or pulled there (``get`` without the detour
        through ``Mapping``: the produce path asks for every run of messages)."""
        return self._subjects.get(name)

    def next_seq(self, name: str) -> int:
        """The seq the next message appended to a subject gets."""
        subject = self._subjects.get(name)
        return 0 if subject is None else subject.next_seq

    # --- live changes ----------------------------------------------------------------------

    def append(
        self, name: str, entries: list[bytes], hashed_ids: list[int], *, framed_bytes: int
    ) -> int:
        """Allocate the next seqs of a subject, one per packed index entry, for messages
        placed in the journal (``framed_bytes`` in all); returns the first."""
        subject = self._subjects.get(name)
        if subject is None:
            subject = self._new(name)
        first = subject._open_start + len(subject._open) // INDEX_ENTRY_SIZE
        at = 0
        while at < len(entries):
            room = INDEX_CHUNK_ENTRIES - len(subject._open) // INDEX_ENTRY_SIZE
            part = entries[at : at + room]
            subject._open += b"".join(part)
            at += len(part)
            if len(subject._open) == CHUNK_BYTES:  # full: the writer seals it on disk
                subject._open_start += INDEX_CHUNK_ENTRIES
                subject._filled = bytes(subject._open)
                subject._open = bytearray()
                subject._crc = subject._crc_end = 0
        subject._bytes += framed_bytes
        self.appended += len(entries)
        dedup = subject._dedup
        assert dedup is not None  # made by _new or recovery
        dedup.add_many(hashed_ids, first)
        return first

    def ensure(self, name: str) -> SubjectLog:
        """The subject, created empty if a pull names it before anything was stored."""
        subject = self._subjects.get(name)
        if subject is None:
            subject = self._new(name)
        return subject

    def make_visible(self, name: str, end: int) -> None:
        """Seqs below ``end`` are durable: pulls may serve them."""
        subject = self._subjects[name]
        if end > subject._end_seq:
            subject._end_seq = min(end, subject.next_seq)
            if subject._end_seq >= subject._open_start:
                subject._filled = None  # written and sealed: its file serves reads now

    def drop_segments_before(self, oldest_segment: int) -> list[tuple[str, int]]:
        """Retention deleted every message segment below ``oldest_segment``.

        Returns the index chunks (subject, first seq) that now point only at deleted
        messages: the caller deletes their files.
        """
        doomed: list[tuple[str, int]] = []
        for subject in self._subjects.values():
            seq = subject._first_seq
            while seq < subject._end_seq:
                segment, length, _, _, _ = subject.raw(seq)
                if segment >= oldest_segment:
                    break
                subject._bytes -= length
                seq += 1
            old_chunk = chunk_start(subject._first_seq)
            subject._first_seq = seq
            doomed += (
                (subject.name, start)
                for start in range(old_chunk, chunk_start(seq), INDEX_CHUNK_ENTRIES)
            )
        return doomed

    def evict_dedup(self, horizon_us: int) -> None:
        """Forget ids stored before ``horizon_us`` (the dedup window's start)."""
        for subject in self._subjects.values():
            if subject._dedup is not None:
                horizon = subject.first_stored_at_or_after(horizon_us)
                subject._dedup.expire_below(window_start(subject._first_seq, horizon))

    def dedup_stores(self) -> list[DedupStore]:
        return [s._dedup for s in self._subjects.values() if s._dedup is not None]

    def close(self) -> None:
        """Save each dedup store's state and release it (blocking: shutdown)."""
        for store in self.dedup_stores():
            store.close()
        self.reader.close()

    # --- recovery --------------------------------------------------------------------------

    @classmethod
    def recovered(
        cls,
        reader: ChunkReader,
        subjects: list[RecoveredSubject],
        *,
        dedup_dir: Path,
        dedup_flush_at: int,
    ) -> SubjectTable:
        """Subjects as recovery rebuilt them; everything indexed is durable."""
        table = cls(reader, dedup_dir=dedup_dir, dedup_flush_at=dedup_flush_at)
        for found in subjects:
            subject = table._subjects[found.name] = SubjectLog(
                found.name,
                reader,
                found.dedup,
                open_start=found.open_start,
                open_entries=found.open_entries,
            )
            subject._first_seq = found.first_seq
            subject._end_seq = subject.next_seq
            subject._bytes = found.bytes
        return table
