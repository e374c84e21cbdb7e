"""Bring a data directory of an older format up to the current one, on start.

Format 1 -> 2: each subject's index was one file, ``index/<subject>.idx``, read whole into
memory; format 2 splits it into chunk files (``broker.storage.index_files``). Segments are
unchanged. The checkpoints' index digests (a CRC of a subject's whole index) become the
format-2 digest (a CRC of the newest chunk's entries) once the old file is checked against
them; an index that no longer matches its digest is not carried over, and recovery
rebuilds it from the log. Each step can be repeated: ``FORMAT`` is rewritten last, so a
crash part way through migrates again on the next start.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any

import orjson

from broker.errors import StorageError
from broker.format import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_SUFFIX,
    chunk_start,
)
from broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE
from broker.storage.fsync import rewrite_file, sync_dir
from broker.storage.index_files import write_chunk

logger = logging.getLogger(__name__)
FORMAT_FILE = "FORMAT"


def migrate(data_dir: Path, version: int) -> list[str]:
    """Migrate ``data_dir`` from format ``version``; returns what was done, a line each."""
    if version != 1:
        raise StorageError(f"{data_dir} holds format {version}; this broker reads 1 and 2")
    done: list[str] = []
    old_indexes = {
        path.name[: -len(INDEX_SUFFIX)]: _entries_of_format_1(path)
        for path in sorted((data_dir / "index").glob(f"*{INDEX_SUFFIX}"))
        if path.is_file()
    }
    matching: dict[str, bool] = {}
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        path = data_dir / name
        if path.exists() and _convert_checkpoint(path, old_indexes, matching):
            done.append(f"{path}: index digests converted to format 2")
    for subject, entries in old_indexes.items():
        if matching.get(subject, True):
            for start in range(0, len(entries), INDEX_CHUNK_ENTRIES * INDEX_ENTRY_SIZE):
                chunk = entries[start : start + INDEX_CHUNK_ENTRIES * INDEX_ENTRY_SIZE]
                write_chunk(data_dir, subject, start // INDEX_ENTRY_SIZE, chunk)
            done.append(f"index of {subject}: {len(entries) // INDEX_ENTRY_SIZE} entries in chunks")
        else:
            done.append(f"index of {subject}: did not match the checkpoint; left to a rebuild")
        (data_dir / "index" / f"{subject}{INDEX_SUFFIX}").unlink()
    sync_dir(data_dir / "index") if (data_dir / "index").is_dir() else None
    rewrite_file(data_dir / FORMAT_FILE, orjson.dumps({"format": 2}))
    sync_dir(data_dir)
    for line in done:
        logger.info(line, extra={"action": "broker.migrated"})
    return done


def _entries_of_format_1(path: Path) -> bytes:
    data = path.read_bytes()
    if len(data) < INDEX_HEADER.size or data[:8] != INDEX_MAGIC:
        return b""  # unreadable: recovery rebuilds it
    count = (len(data) - INDEX_HEADER.size) // INDEX_ENTRY_SIZE
    return data[INDEX_HEADER.size : INDEX_HEADER.size + count * INDEX_ENTRY_SIZE]


def _convert_checkpoint(path: Path, old: dict[str, bytes], matching: dict[str, bool]) -> bool:
    """Rewrite a format-1 checkpoint as format 2 (same CRC framing); whether it was one.

    ``matching`` learns, per subject, whether the old index still matched this digest.
    """
    try:
        doc = orjson.loads(path.read_bytes())
        body: dict[str, Any] = doc["checkpoint"] if "crc32" in doc else doc
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False  # unreadable either way: recovery passes over it
    if body.get("format") != 1:
        return False
    digests: dict[str, list[int]] = {}
    for subject, (count, crc) in body.get("indexes", {}).items():
        entries = old.get(subject, b"")
        covered = entries[: count * INDEX_ENTRY_SIZE]
        same = len(covered) == count * INDEX_ENTRY_SIZE and zlib.crc32(covered) == crc
        matching[subject] = matching.get(subject, True) and same
        newest = covered[chunk_start(count) * INDEX_ENTRY_SIZE :]
        # A digest whose count has no chunks behind it makes recovery rebuild the subject.
        digests[subject] = [count, zlib.crc32(newest) if same else 0, -1, -1]
    body = {**body, "format": 2, "indexes": digests}
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    rewrite_file(path, b'{"crc32":%d,"checkpoint":%s}' % (zlib.crc32(raw), raw))
    return True
