"""A compact set of 64-bit hashes: sorted ``array('Q')`` shards, about 8 bytes per member.

A fraction of the memory a Python ``set`` of ints takes. Membership is a binary search in
one shard; inserts and removals move at most one shard's worth of memory (shards stay
small: the top 12 bits pick one of 4096).
"""

from __future__ import annotations

import bisect
from array import array

SHARD_BITS = 12
_SHIFT = 64 - SHARD_BITS


class HashSet64:
    """Set of unsigned 64-bit integers (hashes); not thread-safe."""

    __slots__ = ("_len", "_shards")

    def __init__(self) -> None:
        self._shards = [array("Q") for _ in range(1 << SHARD_BITS)]
        self._len = 0

    def _find(self, value: int) -> tuple[array[int], int]:
        shard = self._shards[value >> _SHIFT]
        return shard, bisect.bisect_left(shard, value)

    def add(self, value: int) -> bool:
        """Add ``value``; False when it was already present."""
        shard, at = self._find(value)
        if at < len(shard) and shard[at] == value:
            return False
        shard.insert(at, value)
        self._len += 1
        return True

    def add_many(self, values: array[int]) -> None:
        """Add many values at once (recovery): append per shard, then sort each shard."""
        shards = self._shards
        for value in values:
            shards[value >> _SHIFT].append(value)
        total = 0
        for index, shard in enumerate(shards):
            if len(shard) > 1:
                shards[index] = array("Q", sorted(set(shard)))
            total += len(shards[index])
        self._len = total

    def discard(self, value: int) -> bool:
        """Remove ``value``; False when it was not present."""
        shard, at = self._find(value)
        if at < len(shard) and shard[at] == value:
            del shard[at]
            self._len -= 1
            return True
        return False

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        shard, at = self._find(value)
        return at < len(shard) and shard[at] == value

    def __len__(self) -> int:
        return self._len

    def nbytes(self) -> int:
        """Bytes held by the members (the shards' headers not counted)."""
        return sum(shard.buffer_info()[1] * shard.itemsize for shard in self._shards)
