"""Format 2 -> 3 on start: the id hash of index entries and dedup runs becomes XXH3-64;
and 3 -> 4, which only renumbers.

A format-2 data dir is made from a current one by putting BLAKE2b-64 hashes back into
every index entry and the checkpoints' digests, and dedup runs of those hashes, as a
format-2 broker left them. Real engines on real data dirs.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from qmq_broker.dedup.runs import write_run
from qmq_broker.errors import StorageError
from qmq_broker.format import FORMAT_FILE, FORMAT_VERSION, SegmentKind
from qmq_broker.format.ids import id_hash
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    chunk_start,
    index_chunk_path,
    list_index_chunks,
)
from qmq_broker.format.messages import peek_message
from qmq_broker.recovery.migrate import migrate
from qmq_broker.recovery.recover import check_format, recover
from qmq_broker.recovery.verify import verify
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE
from qmq_broker.storage.index_files import read_chunk, write_chunk
from qmq_broker.storage.segments import SegmentReader
from tests.support.engine import run_broker
from tests.unit.test_index_chunks import EXPECTED, TOTAL, fill, resend_and_read


def blake2b_64(message_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(message_id.encode(), digest_size=8).digest(), "little")


def ids_of(data_dir: Path, entries: bytes) -> list[str]:
    reader = SegmentReader(data_dir, SegmentKind.MESSAGES)
    try:
        ids = []
        for at in range(0, len(entries), INDEX_ENTRY_SIZE):
            segment, length, offset, _, _ = INDEX_ENTRY.unpack_from(entries, at)
            ids.append(peek_message(reader.read(segment, offset, length))[3])
        return ids
    finally:
        reader.close()


def make_format_2(data_dir: Path) -> None:
    """Turn a current data dir into what a format-2 broker wrote."""
    old_hashes: list[int] = []
    seqs: list[int] = []
    for start in list_index_chunks(data_dir, "orders"):
        chunk = read_chunk(index_chunk_path(data_dir, "orders", start))
        assert chunk is not None
        entries = bytearray(chunk.entries)
        for n, message_id in enumerate(ids_of(data_dir, chunk.entries)):
            fields = INDEX_ENTRY.unpack_from(entries, n * INDEX_ENTRY_SIZE)
            old = blake2b_64(message_id)
            INDEX_ENTRY.pack_into(entries, n * INDEX_ENTRY_SIZE, *fields[:4], old)
            old_hashes.append(old)
            seqs.append(start + n)
        write_chunk(data_dir, "orders", start, entries)
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        path = data_dir / name
        body = orjson.loads(path.read_bytes())["checkpoint"]
        count = body["indexes"]["orders"][0]
        start = chunk_start(count)
        chunk = read_chunk(index_chunk_path(data_dir, "orders", start))
        assert chunk is not None
        body["indexes"]["orders"][1] = zlib.crc32(
            chunk.entries[: (count - start) * INDEX_ENTRY_SIZE]
        )
        body["format"] = 2
        raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        path.write_bytes(b'{"crc32":%d,"checkpoint":%s}' % (zlib.crc32(raw), raw))
    shutil.rmtree(data_dir / "dedup")
    (data_dir / "dedup" / "orders").mkdir(parents=True)
    write_run(
        data_dir / "dedup" / "orders",
        np.array(old_hashes, dtype=np.uint64),
        np.array(seqs, dtype=np.uint64),
    )
    (data_dir / "FORMAT").write_bytes(b'{"format": 2}')


def entry_hashes(data_dir: Path) -> list[tuple[int, str]]:
    out = []
    for start in list_index_chunks(data_dir, "orders"):
        chunk = read_chunk(index_chunk_path(data_dir, "orders", start))
        assert chunk is not None
        ids = ids_of(data_dir, chunk.entries)
        for n, message_id in enumerate(ids):
            out.append(
                (INDEX_ENTRY.unpack_from(chunk.entries, n * INDEX_ENTRY_SIZE)[4], message_id)
            )
    return out


def format_2_dir(tmp_path: Path) -> Path:
    data_dir = tmp_path / "data"
    run_broker(data_dir, fill)
    run_broker(data_dir, lambda b: asyncio.sleep(0))  # a second checkpoint, the previous one
    make_format_2(data_dir)
    return data_dir


def checkpoint_format(path: Path) -> Any:
    return orjson.loads(path.read_bytes())["checkpoint"]["format"]


def test_a_format_2_data_dir_is_migrated_on_start(tmp_path: Path) -> None:
    data_dir = format_2_dir(tmp_path)
    assert all(h == blake2b_64(i) for h, i in entry_hashes(data_dir))
    assert run_broker(data_dir, resend_and_read) == EXPECTED  # duplicates: the old seqs
    assert orjson.loads((data_dir / "FORMAT").read_bytes()) == {"format": FORMAT_VERSION}
    hashes = entry_hashes(data_dir)
    assert len(hashes) == TOTAL
    assert all(h == id_hash(i) for h, i in hashes)
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        assert checkpoint_format(data_dir / name) == FORMAT_VERSION
    recovered = recover(data_dir, dedup_window_s=3600)
    assert recovered.problems == []  # the digests moved: no index was rebuilt
    recovered.subjects.reader.close()
    assert verify(data_dir).clean


def test_the_step_repeated_after_a_crash_part_way_finds_its_own_work(tmp_path: Path) -> None:
    """A crash after the chunks were rewritten but before the checkpoints: the next start
    migrates again, takes the rewritten chunks for what they are, and rebuilds nothing."""
    data_dir = format_2_dir(tmp_path)
    done = tmp_path / "done"
    shutil.copytree(data_dir, done)
    migrate(done, 2)
    for start in list_index_chunks(done, "orders"):  # the chunks as the first try left them
        shutil.copy(
            index_chunk_path(done, "orders", start), index_chunk_path(data_dir, "orders", start)
        )
    lines = migrate(data_dir, 2)
    assert any("index digests moved" in line for line in lines)
    recovered = recover(data_dir, dedup_window_s=3600)
    assert recovered.problems == []
    recovered.subjects.reader.close()
    assert run_broker(data_dir, resend_and_read) == EXPECTED


def test_a_damaged_sealed_chunk_is_rebuilt_from_the_log_when_migrated(tmp_path: Path) -> None:
    data_dir = format_2_dir(tmp_path)
    path = index_chunk_path(data_dir, "orders", INDEX_CHUNK_ENTRIES)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the sealed chunk's last entry: its seal no longer matches
    path.write_bytes(raw)
    lines = migrate(data_dir, 2)
    assert any("1 damaged chunks rebuilt from the log" in line for line in lines)
    assert all(h == id_hash(i) for h, i in entry_hashes(data_dir))
    assert run_broker(data_dir, resend_and_read) == EXPECTED


def test_a_format_3_data_dir_becomes_format_4_with_nothing_rebuilt(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    run_broker(data_dir, fill)
    run_broker(data_dir, lambda b: asyncio.sleep(0))  # a second checkpoint, the previous one
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):  # as a format-3 broker wrote them
        body = orjson.loads((data_dir / name).read_bytes())["checkpoint"]
        raw = orjson.dumps({**body, "format": 3}, option=orjson.OPT_SORT_KEYS)
        (data_dir / name).write_bytes(b'{"crc32":%d,"checkpoint":%s}' % (zlib.crc32(raw), raw))
    (data_dir / FORMAT_FILE).write_bytes(b'{"format": 3}')
    done = check_format(data_dir)
    assert len(done) == 2
    assert orjson.loads((data_dir / FORMAT_FILE).read_bytes()) == {"format": 4}
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        assert checkpoint_format(data_dir / name) == 4
    recovered = recover(data_dir, dedup_window_s=3600)
    assert recovered.problems == []  # the checkpoint was taken as it is
    recovered.subjects.reader.close()
    assert run_broker(data_dir, resend_and_read) == EXPECTED
    assert verify(data_dir).clean


@pytest.mark.parametrize(
    "content", [b"99", b"[3]", b"not json", b'{"format": "3"}', b'{"format": 5}']
)
def test_a_format_file_that_does_not_name_a_known_version_is_refused(
    tmp_path: Path, content: bytes
) -> None:
    (tmp_path / FORMAT_FILE).write_bytes(content)
    with pytest.raises(StorageError):
        check_format(tmp_path)
