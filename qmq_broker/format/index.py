"""A subject's index: seq -> where its message lives in the message log, in chunk files.

``index/<subject>/<20 digits>.idx`` holds ``INDEX_CHUNK_ENTRIES`` seqs from the one it is
named by: a header (magic, version, entry size, CRC-32 once sealed), then one fixed-size
entry per seq.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

INDEX_MAGIC = b"QMQIDX\x00\x01"
INDEX_SUFFIX = ".idx"
INDEX_ENTRY = struct.Struct("<IIQqQ")  # segment, frame length, offset, stored_us, id hash
INDEX_ENTRY_SIZE = INDEX_ENTRY.size  # 32
INDEX_HEADER = struct.Struct("<8sHHI")  # magic, version, entry size, CRC-32 once sealed
INDEX_VERSION = 2  # 1: one file per subject, the reserved field always 0
INDEX_CHUNK_ENTRIES = 16384  # seqs per index file (512 KiB of entries)
"""Chunk ``k`` of a subject holds seqs ``[k * INDEX_CHUNK_ENTRIES, (k + 1) * ...)``. Once
full it is sealed: the CRC-32 of its entries goes into its header (0 before that)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IndexEntry:
    """Where message ``seq`` of a subject lives in the message log."""

    segment: int
    offset: int
    length: int
    stored_at_us: int
    id_hash: int

    def encode(self) -> bytes:
        return INDEX_ENTRY.pack(
            self.segment, self.length, self.offset, self.stored_at_us, self.id_hash
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview, at: int = 0) -> IndexEntry:
        segment, length, offset, stored, hashed = INDEX_ENTRY.unpack_from(raw, at)
        return cls(
            segment=segment, offset=offset, length=length, stored_at_us=stored, id_hash=hashed
        )


def index_header(sealed_crc: int = 0) -> bytes:
    return INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, INDEX_ENTRY_SIZE, sealed_crc)


def chunk_start(seq: int) -> int:
    """The first seq of the index chunk holding ``seq``."""
    return seq - seq % INDEX_CHUNK_ENTRIES


def entry_offset(seq: int) -> int:
    """Where the entry of ``seq`` starts in its chunk file."""
    return INDEX_HEADER.size + seq % INDEX_CHUNK_ENTRIES * INDEX_ENTRY_SIZE


def index_dir(data_dir: str | os.PathLike[str], subject: str) -> Path:
    return Path(data_dir) / "index" / subject


def index_chunk_path(data_dir: str | os.PathLike[str], subject: str, start: int) -> Path:
    return index_dir(data_dir, subject) / f"{start:020d}{INDEX_SUFFIX}"


def list_index_chunks(data_dir: str | os.PathLike[str], subject: str) -> list[int]:
    """The first seqs of a subject's index chunks on disk, ascending."""
    folder = index_dir(data_dir, subject)
    if not folder.is_dir():
        return []
    return sorted(
        int(path.name[: -len(INDEX_SUFFIX)])
        for path in folder.iterdir()
        if path.name.endswith(INDEX_SUFFIX) and path.name[: -len(INDEX_SUFFIX)].isdigit()
    )


def list_indexed_subjects(data_dir: str | os.PathLike[str]) -> list[str]:
    folder = Path(data_dir) / "index"
    if not folder.is_dir():
        return []
    return sorted(path.name for path in folder.iterdir() if path.is_dir())
