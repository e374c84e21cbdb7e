"""The 64-bit hash of a message id kept in index entries and dedup runs."""

from __future__ import annotations

import xxhash

_XXH3_64 = xxhash.xxh3_64_intdigest


def id_hash(message_id: str) -> int:
    """64-bit hash of a message id: XXH3-64 (seed 0) of its UTF-8 bytes, kept in the index
    and the dedup runs (format 3; formats 1 and 2 used BLAKE2b-64, ten times the cost)."""
    return _XXH3_64(message_id.encode())
