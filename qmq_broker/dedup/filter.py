"""The Bloom filter in front of a subject's dedup runs, and its file ``filter.bin``.

A blocked Bloom filter: ``W`` 64-bit words, and an id hash ``h`` (64 uniform bits) sets
``MASK_BITS = 5`` bits of one word. The word is ``((h >> 32) * W) >> 32`` (the high half
mapped onto ``[0, W)`` by a multiply, no division); the bits are ``MASKS[h & 16383]``, a
fixed table of 16,384 masks of five distinct bits each (``_mask_table``: part of the file
format). One word read and one table read per test, so a single test is a few Python
operations and a batch is a handful of numpy calls, a third of what three scattered bit
positions cost; an insert sets one word.

Sizing: a filter is sized for ``n = max(live ids, MIN_FILTER_IDS)`` with ``W = ceil(n / 4)``
words (16 bits, 2 bytes, per id it is sized for) and takes up to ``capacity = 1.5 * n`` ids,
where it still has 10.7 bits per id.

``filter.bin``, little-endian: a 64-byte header then the ``8 W`` bytes of the words::

    0   8s  magic b"QMQBLOOM"
    8   u16 format version (2; version 1, three positions over a bit array, was format 2's)
    10  u16 bits per mask (5)
    12  u32 reserved, 0
    16  u64 bits (64 W)
    24  u64 ids inserted
    32  u64 ids the filter was sized for (n)
    40  u64 runs_end: every run whose end_seq <= runs_end is in the filter
    48  u32 CRC-32 of the words
    52  8x  reserved, 0
    60  u32 CRC-32 of bytes 0..60 of the header
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
from numpy.typing import NDArray

from qmq_broker.errors import CorruptRecord

FILTER_FILE = "filter.bin"
FILTER_MAGIC = b"QMQBLOOM"
FILTER_VERSION = 2
MASK_BITS = 5
MASK_TABLE_SIZE = 16384
BITS_PER_ID = 16
MIN_FILTER_IDS = 4096
FILTER_HEADER = struct.Struct("<8sHHIQQQQI8xI")
FILTER_HEADER_SIZE = FILTER_HEADER.size  # 64
_HEADER_CRC_AT = FILTER_HEADER_SIZE - 4


_U64 = (1 << 64) - 1


def _mask_table() -> list[int]:
    """Mask ``j``: the first five distinct 6-bit fields (low to high) of SplitMix64 outputs
    seeded with ``j`` (the generator advanced again if ten fields were not enough)."""
    masks = []
    for index in range(MASK_TABLE_SIZE):
        bits: set[int] = set()
        state = index
        while len(bits) < MASK_BITS:
            state = (state + 0x9E3779B97F4A7C15) & _U64
            z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _U64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
            z ^= z >> 31
            for field in range(10):
                bits.add((z >> (6 * field)) & 63)
                if len(bits) == MASK_BITS:
                    break
        masks.append(sum(1 << bit for bit in bits))
    return masks


_MASK_LIST = _mask_table()
_MASKS: NDArray[np.uint64] = np.array(_MASK_LIST, dtype=np.uint64)
_MASK_INDEX = MASK_TABLE_SIZE - 1
_MASK_INDEX_U64 = np.uint64(_MASK_INDEX)
_SHIFT_32 = np.uint64(32)


def _word_count(sized_for: int) -> int:
    return -(-sized_for * BITS_PER_ID // 64)


class BloomFilter:
    """``W`` words over the id hashes of a subject's runs.

    The store's one outstanding job may set bits (``insert``) while the event loop tests
    them: bits are only ever set, and a word is read and written whole (aligned 8 bytes),
    so a test sees each word before or after, and the ids being inserted are still
    answered by the store's frozen dict until the job commits. A job that saves the filter
    reads it while nothing changes it.
    """

    __slots__ = ("_bits", "_word_count", "_words", "_words_u64", "_words_view", "ids", "sized_for")

    def __init__(self, *, sized_for: int, bits: bytearray | None = None, ids: int = 0) -> None:
        self.sized_for = sized_for
        self._word_count = _word_count(sized_for)
        self._bits = bits if bits is not None else bytearray(self._word_count * 8)
        if len(self._bits) != self._word_count * 8:
            raise ValueError("bits do not match the size")
        self._words: NDArray[np.uint64] = np.frombuffer(self._bits, dtype=np.uint64)
        self._words_u64 = np.uint64(self._word_count)
        self._words_view = memoryview(self._bits).cast("Q")
        self.ids = ids

    @classmethod
    def sized(cls, live_ids: int) -> BloomFilter:
        """An empty filter for ``live_ids`` ids (and room to grow to 1.5 times as many)."""
        return cls(sized_for=max(live_ids, MIN_FILTER_IDS))

    @property
    def bit_count(self) -> int:
        return self._word_count * 64

    @property
    def capacity(self) -> int:
        """Ids the filter takes before its false-positive rate passes 1.5 %."""
        return self.sized_for * 3 // 2

    @property
    def nbytes(self) -> int:
        return len(self._bits)

    def might_contain(self, hashed: int) -> bool:
        """False: no run holds ``hashed``. True: one may (about 1 % of absent hashes)."""
        mask = _MASK_LIST[hashed & _MASK_INDEX]
        return self._words_view[((hashed >> 32) * self._word_count) >> 32] & mask == mask

    def might_contain_many(self, hashes: NDArray[np.uint64]) -> NDArray[np.bool_]:
        """``might_contain`` of each hash, vectorised (a produce batch at a time)."""
        masks = _MASKS[hashes & _MASK_INDEX_U64]
        words = self._words[((hashes >> _SHIFT_32) * self._words_u64) >> _SHIFT_32]
        found: NDArray[np.bool_] = (words & masks) == masks
        return found

    def contains_all(self, hashes: NDArray[np.uint64]) -> int:
        """How many of ``hashes`` the filter would wrongly reject (0 when it is sound)."""
        if len(hashes) == 0:
            return 0
        return int(len(hashes) - np.count_nonzero(self.might_contain_many(hashes)))

    def insert(self, hashes: NDArray[np.uint64]) -> None:
        """Add many hashes at once.

        ``bitwise_or.at`` takes repeated words as they come, so no sort is needed. Only bits
        are set: a reader on another thread sees each word before or after, never torn.
        """
        if len(hashes) == 0:
            return
        words = ((hashes >> _SHIFT_32) * self._words_u64) >> _SHIFT_32
        np.bitwise_or.at(self._words, words, _MASKS[hashes & _MASK_INDEX_U64])
        self.ids += len(hashes)

    def encode(self, *, runs_end: int) -> tuple[bytes, bytearray]:
        """Header and bits of ``filter.bin``; the bits are this filter's own buffer."""
        header = FILTER_HEADER.pack(
            FILTER_MAGIC,
            FILTER_VERSION,
            MASK_BITS,
            0,
            self.bit_count,
            self.ids,
            self.sized_for,
            runs_end,
            zlib.crc32(self._bits),
            0,
        )
        crc = zlib.crc32(header[:_HEADER_CRC_AT])
        return header[:_HEADER_CRC_AT] + struct.pack("<I", crc), self._bits

    @classmethod
    def decode(cls, data: bytes, *, path: str) -> tuple[BloomFilter, int]:
        """The filter in ``data`` (a whole ``filter.bin``) and its ``runs_end``.

        Raises ``CorruptRecord`` when the header or the bits fail their checks.
        """

        def damaged(reason: str) -> CorruptRecord:
            return CorruptRecord(path=path, offset=0, reason=reason)

        if len(data) < FILTER_HEADER_SIZE:
            raise damaged("filter header cut short")
        fields = FILTER_HEADER.unpack_from(data, 0)
        magic, version, k, _, bit_count, ids, sized_for, runs_end, bits_crc, header_crc = fields
        if magic != FILTER_MAGIC:
            raise damaged("not a dedup filter (bad magic)")
        if zlib.crc32(data[:_HEADER_CRC_AT]) != header_crc:
            raise damaged("filter header CRC mismatch")
        if version != FILTER_VERSION or k != MASK_BITS:
            raise damaged(f"unsupported filter version {version} with {k} bits per mask")
        if sized_for <= 0 or bit_count != 64 * _word_count(sized_for):
            raise damaged(f"{bit_count} bits do not fit a filter sized for {sized_for} ids")
        if len(data) != FILTER_HEADER_SIZE + bit_count // 8:
            raise damaged(f"{len(data)} bytes, expected {FILTER_HEADER_SIZE + bit_count // 8}")
        bits = bytearray(data[FILTER_HEADER_SIZE:])
        if zlib.crc32(bits) != bits_crc:
            raise damaged("filter bits CRC mismatch")
        return cls(sized_for=sized_for, bits=bits, ids=ids), runs_end
