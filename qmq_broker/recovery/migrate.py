"""Bring a data directory of an older format up to the current one, on start.

Each step brings a data directory one format up, and writes ``FORMAT`` last: a crash part
way through a step runs it again on the next start, and every step can be repeated.

Format 1 -> 2: each subject's index was one file, ``index/<subject>.idx``, read whole into
memory; format 2 splits it into chunk files (``qmq_broker.storage.index_files``). Segments are
unchanged. The checkpoints' index digests (a CRC of a subject's whole index) become the
format-2 digest (a CRC of the newest chunk's entries) once the old file is checked against
them; an index that no longer matches its digest is not carried over, and recovery
rebuilds it from the log.

Format 2 -> 3: the id hash of index entries and dedup runs went from BLAKE2b-64 to XXH3-64
(``qmq_broker.format.ids.id_hash``). Every index entry's message is read from the log and its id
hashed anew; the chunks are rewritten (and sealed again, if full). A sealed chunk that
fails its seal is rebuilt from the log first (``qmq_broker.recovery.index_repair``). Entries
whose message does not read back (retention took its segment, or damage) keep their old
hash: no dedup lookup reaches them. Each checkpoint's digest of a subject's newest chunk
is checked against the entries as they were (or as this step already rewrote them, after
a crash) and moved to the new hashes; a digest that did not match stays as it was, so
recovery rebuilds that index from the log, as it would have. The dedup runs and filters
are deleted and written anew from the ids read, one run per ``RUN_CHUNKS`` chunks. The
step reads every retained message once.

Format 3 -> 4: log segments may end in room, zero bytes the writer allocated ahead of its
appends (``qmq_broker.format``). Nothing on disk changes: the checkpoints are written again
with the new format number, then ``FORMAT``. A format-3 broker must not open a format-4
directory, whose room it would take for a torn tail.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from qmq_broker.dedup import DedupStore
from qmq_broker.dedup.runs import write_run
from qmq_broker.errors import CorruptRecord, StorageError
from qmq_broker.format.files import FORMAT_FILE, FORMAT_VERSION, SegmentKind
from qmq_broker.format.ids import id_hash
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_SUFFIX,
    chunk_start,
    index_chunk_path,
    list_index_chunks,
    list_indexed_subjects,
)
from qmq_broker.format.messages import peek_message
from qmq_broker.recovery.index_repair import rebuild_chunk
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE
from qmq_broker.storage.fsync import rewrite_file, sync_dir
from qmq_broker.storage.index_files import read_chunk, write_chunk
from qmq_broker.storage.lock import DataDirLock
from qmq_broker.storage.segments import SegmentReader

logger = logging.getLogger(__name__)
RUN_CHUNKS = 64  # index chunks whose ids go into one dedup run in the 2 -> 3 step (1M ids)


def migrate(data_dir: Path, version: int) -> list[str]:
    """Migrate ``data_dir`` from format ``version``; returns what was done, a line each.
    ``DataDirLocked`` while another process holds ``data_dir``."""
    if version not in (1, 2, 3):
        raise StorageError(
            f"{data_dir} holds format {version}; this broker reads 1 to {FORMAT_VERSION}"
        )
    with DataDirLock(data_dir):
        return _migrate(data_dir, version)


def _migrate(data_dir: Path, version: int) -> list[str]:
    done: list[str] = []
    if version == 1:
        done += _format_1_to_2(data_dir)
    if version <= 2:
        done += _format_2_to_3(data_dir)
    done += _format_3_to_4(data_dir)
    for line in done:
        logger.info(line, extra={"action": "broker.migrated"})
    return done


def _write_format(data_dir: Path, version: int) -> None:
    rewrite_file(data_dir / FORMAT_FILE, orjson.dumps({"format": version}))
    sync_dir(data_dir)


def _format_1_to_2(data_dir: Path) -> list[str]:
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
    _write_format(data_dir, 2)
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


def _blake2b_64(message_id: str) -> int:
    """The id hash of formats 1 and 2."""
    return int.from_bytes(hashlib.blake2b(message_id.encode(), digest_size=8).digest(), "little")


def _format_2_to_3(data_dir: Path) -> list[str]:
    done: list[str] = []
    checkpoints: dict[str, dict[str, Any]] = {}
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        body = _checkpoint_body(data_dir / name)
        if body is not None and body.get("format") == 2:
            checkpoints[name] = body
    reader = SegmentReader(data_dir, SegmentKind.MESSAGES)
    shutil.rmtree(data_dir / "dedup", ignore_errors=True)
    try:
        for subject in list_indexed_subjects(data_dir):
            done.append(_rehash_subject(data_dir, subject, reader, checkpoints))
    finally:
        reader.close()
    for name, body in checkpoints.items():
        _write_checkpoint(data_dir / name, {**body, "format": 3})
        done.append(f"{data_dir / name}: index digests moved to the XXH3-64 id hash")
    _write_format(data_dir, 3)
    return done


def _format_3_to_4(data_dir: Path) -> list[str]:
    done: list[str] = []
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        body = _checkpoint_body(data_dir / name)
        if body is not None and body.get("format") == 3:
            _write_checkpoint(data_dir / name, {**body, "format": 4})
            done.append(f"{data_dir / name}: format 4 (log segments may end in room)")
    _write_format(data_dir, 4)
    return done


def _write_checkpoint(path: Path, body: dict[str, Any]) -> None:
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    rewrite_file(path, b'{"crc32":%d,"checkpoint":%s}' % (zlib.crc32(raw), raw))


def _checkpoint_body(path: Path) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(path.read_bytes())
        body: dict[str, Any] = doc["checkpoint"] if "crc32" in doc else doc
    except (FileNotFoundError, orjson.JSONDecodeError, KeyError, TypeError):
        return None  # missing or unreadable either way: recovery passes over it
    return body if isinstance(body, dict) else None


def _rehash_subject(
    data_dir: Path,
    subject: str,
    reader: SegmentReader,
    checkpoints: dict[str, dict[str, Any]],
) -> str:
    """Rehash one subject's index chunks and write its dedup runs; says what it did."""
    dedup_dir = data_dir / "dedup" / subject
    dedup_dir.mkdir(parents=True, exist_ok=True)
    hashes: list[int] = []
    seqs: list[int] = []
    rehashed = unreadable = rebuilt = left = runs = 0
    chunks = list_index_chunks(data_dir, subject)
    digested = {  # the chunks a checkpoint's digest covers: their old hashes are needed
        chunk_start(digest[0])
        for body in checkpoints.values()
        if isinstance(digest := body.get("indexes", {}).get(subject), list) and digest
    }
    for start in chunks:
        path = index_chunk_path(data_dir, subject, start)
        chunk = read_chunk(path)
        if chunk is not None and not chunk.seal_matches():
            rebuild_chunk(data_dir, subject, start)  # from the log, with the new hash
            rebuilt += 1
            chunk = read_chunk(path)
        if chunk is None:
            left += 1  # not an index file: recovery rebuilds this subject's index
            continue
        entries = bytearray(chunk.entries)
        # as formats 1 and 2 hash, for a digest (kept None elsewhere: BLAKE2b costs)
        before = bytearray(chunk.entries) if start in digested else None
        for at in range(0, len(entries), INDEX_ENTRY_SIZE):
            segment, length, offset, stored_us, _ = INDEX_ENTRY.unpack_from(entries, at)
            seq = start + at // INDEX_ENTRY_SIZE
            try:
                found_seq, _, found_subject, message_id = peek_message(
                    reader.read(segment, offset, length)
                )
            except (StorageError, CorruptRecord):
                unreadable += 1
                continue
            if found_seq != seq or found_subject != subject:
                unreadable += 1
                continue
            new_hash = id_hash(message_id)
            INDEX_ENTRY.pack_into(entries, at, segment, length, offset, stored_us, new_hash)
            if before is not None:
                INDEX_ENTRY.pack_into(
                    before, at, segment, length, offset, stored_us, _blake2b_64(message_id)
                )
            hashes.append(new_hash)
            seqs.append(seq)
            rehashed += 1
        if before is not None:
            _move_digests(checkpoints, subject, start, chunk.entries, bytes(before), entries)
        write_chunk(data_dir, subject, start, entries)
        if len(hashes) >= RUN_CHUNKS * INDEX_CHUNK_ENTRIES:
            runs += _write_run(dedup_dir, hashes, seqs)
            hashes, seqs = [], []
    runs += _write_run(dedup_dir, hashes, seqs)
    DedupStore.open(dedup_dir).close()  # builds and saves the filter over the runs
    sync_dir(dedup_dir.parent)
    return (
        f"index of {subject}: {rehashed} ids hashed anew in {len(chunks) - left} chunks, "
        f"{unreadable} entries not readable, {rebuilt} damaged chunks rebuilt from the log, "
        f"{left} not index files, {runs} dedup runs"
    )


def _write_run(directory: Path, hashes: list[int], seqs: list[int]) -> int:
    header = write_run(
        directory, np.array(hashes, dtype=np.uint64), np.array(seqs, dtype=np.uint64)
    )
    return 0 if header is None else 1


def _move_digests(
    checkpoints: dict[str, dict[str, Any]],
    subject: str,
    start: int,
    as_found: bytes,
    as_before: bytes,
    rehashed: bytearray,
) -> None:
    """Move the digests of the chunk at ``start`` to its rehashed entries where they match
    it as found (format 2) or as it was before this step rewrote it (a repeated step)."""
    for body in checkpoints.values():
        digest = body.get("indexes", {}).get(subject)
        if not isinstance(digest, list) or len(digest) != 4 or chunk_start(digest[0]) != start:
            continue
        size = (digest[0] - start) * INDEX_ENTRY_SIZE
        if size > len(as_found):
            continue  # the chunk lost entries the checkpoint saw: recovery rebuilds it
        if digest[1] in (zlib.crc32(as_found[:size]), zlib.crc32(as_before[:size])):
            digest[1] = zlib.crc32(rehashed[:size])
