"""Subjects: each one's index entries, visible end, dedup table and counters.

``SubjectTable`` is the only code that changes a subject. It keeps the invariants
``first_seq <= end_seq <= next_seq``: ``next_seq`` counts allocated messages, ``end_seq`` the
ones durable and visible to pulls, ``first_seq`` the oldest that retention has not deleted.
Everyone else reads a ``SubjectLog`` through its properties.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Iterator, Mapping

from broker.format import INDEX_ENTRY, INDEX_ENTRY_SIZE

_FRAME_LENGTH = struct.Struct("<4xI")  # the frame length field of a packed INDEX_ENTRY


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SubjectStats:
    subject: str
    messages: int
    bytes: int
    first_seq: int
    next_seq: int  # the visible end: the seq the next stored message will get


class SubjectLog:
    """One subject's index entries, held in memory as the packed bytes of its index file."""

    __slots__ = (
        "_bytes",
        "_crc",
        "_crc_end",
        "_dedup",
        "_end_seq",
        "_entries",
        "_first_seq",
        "name",
    )

    def __init__(self, name: str, entries: bytearray | None = None) -> None:
        self.name = name
        self._entries = entries if entries is not None else bytearray()
        self._first_seq = 0
        self._end_seq = self.next_seq
        self._dedup: dict[int, int] = {}  # id hash -> seq, oldest first
        self._bytes = 0
        self._crc = zlib.crc32(self._entries)  # of the packed entries up to _crc_end
        self._crc_end = len(self._entries)  # appends leave the CRC to the next checkpoint

    @property
    def first_seq(self) -> int:
        return self._first_seq

    @property
    def end_seq(self) -> int:
        return self._end_seq

    @property
    def next_seq(self) -> int:
        return len(self._entries) // INDEX_ENTRY_SIZE

    def raw(self, seq: int) -> tuple[int, int, int, int, int]:
        """(segment, length, offset, stored_us, id_hash) of a seq, without an object."""
        values: tuple[int, int, int, int, int] = INDEX_ENTRY.unpack_from(
            self._entries, seq * INDEX_ENTRY_SIZE
        )
        return values

    @property
    def dedup_size(self) -> int:
        """How many ids the dedup table holds."""
        return len(self._dedup)

    def seq_of(self, hashed_id: int) -> int | None:
        """The seq stored under an id hash within the dedup window, if any."""
        return self._dedup.get(hashed_id)

    def stats(self) -> SubjectStats:
        return SubjectStats(
            subject=self.name,
            messages=max(self._end_seq - self._first_seq, 0),
            bytes=self._bytes,
            first_seq=self._first_seq,
            next_seq=self._end_seq,
        )


class SubjectTable(Mapping[str, SubjectLog]):
    """Every subject of the broker by name; the one writer of their fields."""

    def __init__(self) -> None:
        self._subjects: dict[str, SubjectLog] = {}

    # --- reading ---------------------------------------------------------------------------

    def __getitem__(self, name: str) -> SubjectLog:
        return self._subjects[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._subjects)

    def __len__(self) -> int:
        return len(self._subjects)

    def messages(self) -> int:
        return sum(s.end_seq - s.first_seq for s in self._subjects.values())

    def index_digests(self) -> dict[str, tuple[int, int]]:
        """Per subject: how many index entries, and the CRC-32 of them (for checkpoints)."""
        for subject in self._subjects.values():
            end = len(subject._entries)
            if subject._crc_end < end:  # entries appended since the last digest
                subject._crc = zlib.crc32(subject._entries[subject._crc_end : end], subject._crc)
                subject._crc_end = end
        return {name: (s.next_seq, s._crc) for name, s in self._subjects.items()}

    def find(self, name: str) -> SubjectLog | None:
        """The subject, if anything was stored or pulled there (``get`` without the detour
        through ``Mapping``: the produce path asks for every run of messages)."""
        return self._subjects.get(name)

    def next_seq(self, name: str) -> int:
        """The seq the next message appended to a subject gets."""
        subject = self._subjects.get(name)
        return 0 if subject is None else len(subject._entries) // INDEX_ENTRY_SIZE

    # --- live changes ----------------------------------------------------------------------

    def append(self, name: str, packed_entry: bytes, hashed_id: int) -> int:
        """Allocate the next seq of a subject for a message placed in the journal."""
        subject = self._subjects.get(name)
        if subject is None:
            subject = self._subjects[name] = SubjectLog(name)
        entries = subject._entries
        seq = len(entries) // INDEX_ENTRY_SIZE
        entries += packed_entry
        subject._bytes += _FRAME_LENGTH.unpack_from(packed_entry)[0]
        subject._dedup[hashed_id] = seq
        return seq

    def ensure(self, name: str) -> SubjectLog:
        """The subject, created empty if a pull names it before anything was stored."""
        subject = self._subjects.get(name)
        if subject is None:
            subject = self._subjects[name] = SubjectLog(name)
        return subject

    def make_visible(self, name: str, end: int) -> None:
        """Seqs below ``end`` are durable: pulls may serve them."""
        subject = self._subjects[name]
        if end > subject._end_seq:
            subject._end_seq = min(end, subject.next_seq)

    def drop_segments_before(self, oldest_segment: int) -> None:
        """Retention deleted every message segment below ``oldest_segment``."""
        for subject in self._subjects.values():
            seq = subject._first_seq
            while seq < subject._end_seq:
                segment, length, _, _, _ = subject.raw(seq)
                if segment >= oldest_segment:
                    break
                subject._bytes -= length
                seq += 1
            subject._first_seq = seq

    def evict_dedup(self, horizon_us: int) -> None:
        """Forget ids stored before ``horizon_us`` (the dedup window's start)."""
        for subject in self._subjects.values():
            stale = []
            for hashed, seq in subject._dedup.items():
                if subject.raw(seq)[3] >= horizon_us:
                    break
                stale.append(hashed)
            for hashed in stale:
                del subject._dedup[hashed]

    # --- recovery --------------------------------------------------------------------------

    @classmethod
    def recovered(
        cls,
        entries: Mapping[str, bytearray],
        *,
        oldest_segment: int,
        dedup_horizon_us: int,
    ) -> SubjectTable:
        """Subjects rebuilt from their index entries; everything indexed is durable.

        ``first_seq`` is the first entry whose segment still exists; ids stored at or after
        ``dedup_horizon_us`` enter the dedup table (ids are hashed in the index, so the log
        is not re-read).
        """
        table = cls()
        for name, packed in entries.items():
            subject = table._subjects[name] = SubjectLog(name, packed)
            count = subject.next_seq
            low, high = 0, count
            while low < high:  # first seq whose segment still exists
                mid = (low + high) // 2
                if subject.raw(mid)[0] < oldest_segment:
                    low = mid + 1
                else:
                    high = mid
            subject._first_seq = low
            subject._end_seq = count
            view = memoryview(packed)[low * INDEX_ENTRY_SIZE :]
            dedup = subject._dedup
            total = 0
            for seq, (_, length, _, stored, hashed) in enumerate(
                INDEX_ENTRY.iter_unpack(view), start=low
            ):
                total += length
                if stored >= dedup_horizon_us:
                    dedup[hashed] = seq
            subject._bytes = total
        return table
