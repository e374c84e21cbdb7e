"""The Bloom filter in front of a subject's dedup runs, and its file ``filter.bin``.

Bits: ``m`` bits in a ``bytearray``, bit ``p`` being ``bits[p >> 3] >> (p & 7) & 1``. An id
hash ``h`` (64 uniform bits) sets ``k = 3`` positions by double hashing: ``a = h & 0xFFFFFFFF``,
``b = (h >> 32) | 1``, ``p_i = (a + i * b) % m`` for ``i = 0, 1, 2``. Single tests run in
pure Python (three byte reads); inserts and queries of many hashes are vectorised with
numpy.

Sizing: a filter is sized for ``n = max(live ids, MIN_FILTER_IDS)`` with ``m = 16 * n`` bits
(2 bytes per id it is sized for) and takes up to ``capacity = 1.5 * n`` ids, where it still
has 10.7 bits per id: a false-positive rate of at most 1.5 % (0.5 % right after sizing).

``filter.bin``, little-endian: a 64-byte header then the ``m / 8`` bytes of bits::

    0   8s  magic b"QMQBLOOM"
    8   u16 format version (1)
    10  u16 k, hash positions per id (3)
    12  u32 reserved, 0
    16  u64 m, bits
    24  u64 ids inserted
    32  u64 ids the filter was sized for (n)
    40  u64 runs_end: every run whose end_seq <= runs_end is in the filter
    48  u32 CRC-32 of the bits
    52  8x  reserved, 0
    60  u32 CRC-32 of bytes 0..60 of the header
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
from numpy.typing import NDArray

from broker.errors import CorruptRecord

FILTER_FILE = "filter.bin"
FILTER_MAGIC = b"QMQBLOOM"
FILTER_VERSION = 1
HASH_COUNT = 3
BITS_PER_ID = 16
MIN_FILTER_IDS = 4096
FILTER_HEADER = struct.Struct("<8sHHIQQQQI8xI")
FILTER_HEADER_SIZE = FILTER_HEADER.size  # 64
_HEADER_CRC_AT = FILTER_HEADER_SIZE - 4

_LOW_32 = np.uint64(0xFFFFFFFF)
_SHIFT_32 = np.uint64(32)
_ONE = np.uint64(1)
_TWO = np.uint64(2)
_THREE = np.uint64(3)
_SEVEN = np.uint64(7)


def _positions(hashes: NDArray[np.uint64], bit_count: int) -> NDArray[np.uint64]:
    # a + 2b < 3 * 2**32: no overflow in uint64
    a = hashes & _LOW_32
    b = (hashes >> _SHIFT_32) | _ONE
    m = np.uint64(bit_count)
    return np.concatenate((a % m, (a + b) % m, (a + _TWO * b) % m))


class BloomFilter:
    """``m`` bits over the id hashes of a subject's runs.

    The store's one outstanding job may set bits (``insert``) while the event loop tests
    them: bits are only ever set, so a test sees each byte before or after, and the ids
    being inserted are still answered by the store's frozen dict until the job commits.
    A job that saves the filter reads it while nothing changes it.
    """

    __slots__ = ("_bits", "_view", "bit_count", "ids", "sized_for")

    def __init__(self, *, sized_for: int, bits: bytearray | None = None, ids: int = 0) -> None:
        self.sized_for = sized_for
        self.bit_count = BITS_PER_ID * sized_for
        self._bits = bits if bits is not None else bytearray(self.bit_count // 8)
        if len(self._bits) * 8 != self.bit_count:
            raise ValueError("bits do not match the size")
        self._view: NDArray[np.uint8] = np.frombuffer(self._bits, dtype=np.uint8)
        self.ids = ids

    @classmethod
    def sized(cls, live_ids: int) -> BloomFilter:
        """An empty filter for ``live_ids`` ids (and room to grow to 1.5 times as many)."""
        return cls(sized_for=max(live_ids, MIN_FILTER_IDS))

    @property
    def capacity(self) -> int:
        """Ids the filter takes before its false-positive rate passes 1.5 %."""
        return self.sized_for * 3 // 2

    @property
    def nbytes(self) -> int:
        return len(self._bits)

    def might_contain(self, hashed: int) -> bool:
        """False: no run holds ``hashed``. True: one may (about 1 % of absent hashes)."""
        m = self.bit_count
        bits = self._bits
        a = hashed & 0xFFFFFFFF
        b = (hashed >> 32) | 1
        p = a % m
        if not bits[p >> 3] >> (p & 7) & 1:
            return False
        p = (a + b) % m
        if not bits[p >> 3] >> (p & 7) & 1:
            return False
        p = (a + 2 * b) % m
        return bool(bits[p >> 3] >> (p & 7) & 1)

    def might_contain_many(self, hashes: NDArray[np.uint64]) -> NDArray[np.bool_]:
        """``might_contain`` of each hash, vectorised (a produce batch at a time)."""
        positions = _positions(hashes, self.bit_count)
        set_ = (self._view[(positions >> _THREE).astype(np.intp)] >> (positions & _SEVEN)) & 1
        found: NDArray[np.bool_] = np.all(set_.reshape(HASH_COUNT, len(hashes)) == 1, axis=0)
        return found

    def contains_all(self, hashes: NDArray[np.uint64]) -> int:
        """How many of ``hashes`` the filter would wrongly reject (0 when it is sound)."""
        if len(hashes) == 0:
            return 0
        positions = _positions(hashes, self.bit_count)
        set_ = (self._view[(positions >> _THREE).astype(np.intp)] >> (positions & _SEVEN)) & 1
        present = set_.reshape(HASH_COUNT, len(hashes)).all(axis=0)
        return int(len(hashes) - np.count_nonzero(present))

    def insert(self, hashes: NDArray[np.uint64]) -> None:
        """Add many hashes at once.

        ``bitwise_or.at`` takes repeated bytes as they come, so no sort is needed. Only bits
        are set: a reader on another thread sees each byte before or after, never torn.
        """
        if len(hashes) == 0:
            return
        positions = _positions(hashes, self.bit_count)
        masks = np.left_shift(np.uint8(1), (positions & _SEVEN).astype(np.uint8))
        np.bitwise_or.at(self._view, (positions >> _THREE).astype(np.intp), masks)
        self.ids += len(hashes)

    def encode(self, *, runs_end: int) -> tuple[bytes, bytearray]:
        """Header and bits of ``filter.bin``; the bits are this filter's own buffer."""
        header = FILTER_HEADER.pack(
            FILTER_MAGIC,
            FILTER_VERSION,
            HASH_COUNT,
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
        if version != FILTER_VERSION or k != HASH_COUNT:
            raise damaged(f"unsupported filter version {version} with k={k}")
        if bit_count != BITS_PER_ID * sized_for or sized_for <= 0:
            raise damaged(f"{bit_count} bits do not fit a filter sized for {sized_for} ids")
        if len(data) != FILTER_HEADER_SIZE + bit_count // 8:
            raise damaged(f"{len(data)} bytes, expected {FILTER_HEADER_SIZE + bit_count // 8}")
        bits = bytearray(data[FILTER_HEADER_SIZE:])
        if zlib.crc32(bits) != bits_crc:
            raise damaged("filter bits CRC mismatch")
        return cls(sized_for=sized_for, bits=bits, ids=ids), runs_end
