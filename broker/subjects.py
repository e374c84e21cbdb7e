"""A subject's in-memory view: its index entries, visible end, dedup table and counters."""

from __future__ import annotations

from broker.format import INDEX_ENTRY, INDEX_ENTRY_SIZE, IndexEntry


class SubjectLog:
    """Index entries of one subject, held in memory as the packed bytes of its index file.

    ``next_seq`` counts allocated messages; ``end_seq`` the ones durable and visible to
    pulls. ``dedup`` maps id hashes to seqs for the dedup window, oldest first.
    """

    __slots__ = ("bytes_total", "dedup", "end_seq", "entries", "first_seq", "name")

    def __init__(self, name: str, entries: bytearray | None = None) -> None:
        self.name = name
        self.entries = entries if entries is not None else bytearray()
        self.first_seq = 0
        self.end_seq = self.next_seq
        self.dedup: dict[int, int] = {}
        self.bytes_total = 0

    @property
    def next_seq(self) -> int:
        return len(self.entries) // INDEX_ENTRY_SIZE

    def allocate(self, packed_entry: bytes) -> int:
        seq = self.next_seq
        self.entries += packed_entry
        return seq

    def entry(self, seq: int) -> IndexEntry:
        return IndexEntry.decode(memoryview(self.entries), seq * INDEX_ENTRY_SIZE)

    def raw(self, seq: int) -> tuple[int, int, int, int, int]:
        """(segment, length, offset, stored_us, id_hash) of a seq, without an object."""
        values: tuple[int, int, int, int, int] = INDEX_ENTRY.unpack_from(
            self.entries, seq * INDEX_ENTRY_SIZE
        )
        return values

    def stats(self) -> dict[str, int | str]:
        return {
            "subject": self.name,
            "messages": max(self.end_seq - self.first_seq, 0),
            "bytes": self.bytes_total,
            "first_seq": self.first_seq,
            "next_seq": self.end_seq,
        }
