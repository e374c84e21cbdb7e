"""The subject index on disk in chunks: rolling, sealing, trimming, recovery and migration.

Real engines on real data dirs; ``INDEX_CHUNK_ENTRIES`` (16,384) is the production value,
so these tests store a few chunks' worth of small messages.
"""

from __future__ import annotations

import asyncio
import shutil
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from qmq_broker.config import BrokerConfig
from qmq_broker.engine import Broker
from qmq_broker.errors import StorageError
from qmq_broker.format import FORMAT_VERSION, SegmentKind
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_MAGIC,
    chunk_start,
    index_chunk_path,
    list_index_chunks,
)
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.pulls.reads import read_message
from qmq_broker.recovery.recover import recover
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE
from qmq_broker.storage.index_files import ChunkReader, read_chunk
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectStats, SubjectTable
from tests.support.engine import incoming, run_broker
from tests.unit.test_retention import SkewedClock

TOTAL = 2 * INDEX_CHUNK_ENTRIES + 5_000  # two sealed chunks and an open one
BATCH = 1_000


def body(i: int) -> bytes:
    return f"b{i}".encode()


async def fill(broker: Broker, start: int = 0, stop: int = TOTAL) -> list[int]:
    seqs = []
    for first in range(start, stop, BATCH):
        answers = await broker.services.producer.produce(
            [incoming(i, body=body(i)) for i in range(first, min(first + BATCH, stop))]
        )
        assert {a["status"] for a in answers} == {"stored"}
        seqs += [a["seq"] for a in answers if a["seq"] is not None]
    return seqs


async def read_seq(broker: Broker, seq: int) -> dict[str, Any]:
    """The message at ``seq``, read through the subject's index as pulls read it."""
    assert broker.recovered is not None
    reader = SegmentReader(broker.config.data_dir, SegmentKind.MESSAGES)
    try:
        record = read_message(reader, broker.recovered.subjects["orders"], seq)
    finally:
        reader.close()
    return {"seq": record.seq, "id": record.id}


def subjects_of(broker: Broker) -> SubjectTable:
    assert broker.recovered is not None
    return broker.recovered.subjects


def test_entries_roll_into_sealed_chunks_and_old_seqs_read_from_disk(tmp_path: Path) -> None:
    async def scenario(broker: Broker) -> None:
        assert await fill(broker) == list(range(TOTAL))
        # only the newest chunk's entries are held in memory
        held = subjects_of(broker).memory_bytes()
        assert held == (TOTAL - 2 * INDEX_CHUNK_ENTRIES) * INDEX_ENTRY_SIZE
        for seq in (0, 1, INDEX_CHUNK_ENTRIES - 1, INDEX_CHUNK_ENTRIES, TOTAL - 1):
            message = await read_seq(broker, seq)
            assert (message["seq"], message["id"]) == (seq, f"m-{seq}")
        # a pull's run of seqs across sealed blocks and chunks and into the open chunk
        log = subjects_of(broker)["orders"]
        run = [*range(120, 300), *range(2 * INDEX_CHUNK_ENTRIES - 70, 2 * INDEX_CHUNK_ENTRIES + 9)]
        run += [5, TOTAL - 1, 7]
        expected = [
            (segment, offset, length) for segment, length, offset, _, _ in map(log.raw, run)
        ]
        assert log.positions(run) == expected

    run_broker(tmp_path, scenario)
    chunks = [0, INDEX_CHUNK_ENTRIES, 2 * INDEX_CHUNK_ENTRIES]
    assert list_index_chunks(tmp_path, "orders") == chunks
    for start in chunks[:2]:
        chunk = read_chunk(index_chunk_path(tmp_path, "orders", start))
        assert chunk is not None
        assert chunk.full
        assert chunk.sealed_crc == zlib.crc32(chunk.entries) != 0
    newest = read_chunk(index_chunk_path(tmp_path, "orders", chunks[2]))
    assert newest is not None
    assert newest.sealed_crc == 0
    assert len(newest.entries) == 5_000 * INDEX_ENTRY_SIZE


def counted_from_scratch(data_dir: Path, copy: Path) -> SubjectStats:
    """The subject's stats recovered with no checkpoint at all: a full recount."""
    shutil.copytree(data_dir, copy)
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        (copy / name).unlink(missing_ok=True)
    recovered = recover(copy, dedup_window_s=3600)
    stats = recovered.subjects["orders"].stats()
    recovered.subjects.reader.close()
    return stats


def test_a_restart_counts_from_the_checkpoint_and_the_tail(tmp_path: Path) -> None:
    data = tmp_path / "data"
    before = run_broker(data, lambda b: _fill_then_stats(b, 0, TOTAL))
    recovered = recover(data, dedup_window_s=3600)
    assert recovered.subjects["orders"].stats() == before
    assert recovered.problems == []
    recovered.subjects.reader.close()

    # As if killed after 3,000 more: the checkpoint at close is lost, the one before it
    # (at TOTAL) is what recovery starts from; the log past it is indexed again.
    after = run_broker(data, lambda b: _fill_then_stats(b, TOTAL, TOTAL + 3_000))
    (data / CHECKPOINT_FILE).unlink()
    recovered = recover(data, dedup_window_s=3600)
    assert recovered.subjects["orders"].stats() == after
    recovered.subjects.reader.close()
    assert counted_from_scratch(data, tmp_path / "copy") == after
    assert after.next_seq == TOTAL + 3_000
    assert after.bytes > before.bytes


async def _fill_then_stats(broker: Broker, start: int, stop: int) -> SubjectStats:
    await fill(broker, start, stop)
    return subjects_of(broker)["orders"].stats()


def flip_entry(data_dir: Path, seq: int, field_at: int) -> None:
    path = index_chunk_path(data_dir, "orders", chunk_start(seq))
    at = INDEX_HEADER.size + (seq % INDEX_CHUNK_ENTRIES) * INDEX_ENTRY_SIZE + field_at
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(raw)


@pytest.mark.parametrize("segment_bytes", [256 * 1024, 64 * 1024 * 1024], ids=["many", "one"])
def test_a_sealed_chunk_that_fails_its_crc_is_rebuilt_from_the_log(
    tmp_path: Path, segment_bytes: int
) -> None:
    """With many segments recovery holds only the tail and leaves the damaged chunk to the
    first read; with one segment it holds every chunk and checks each as it loads it."""
    run_broker(tmp_path, fill, segment_bytes=segment_bytes)
    for seq in (5, 100, 9_000):
        flip_entry(tmp_path, seq, field_at=8)  # the offset: would read another frame
    recovered = recover(tmp_path, dedup_window_s=3600)
    rebuilt = [p for p in recovered.problems if "failed its CRC; rebuilt from the log" in p]
    assert len(rebuilt) == (0 if segment_bytes < 1024 * 1024 else 1)
    recovered.subjects.reader.close()

    async def reads(broker: Broker) -> list[tuple[int, str]]:
        answers = [await read_seq(broker, seq) for seq in (5, 100, 9_000, 20_000)]
        return [(a["seq"], a["id"]) for a in answers]

    expected = [(s, f"m-{s}") for s in (5, 100, 9_000, 20_000)]
    assert run_broker(tmp_path, reads, segment_bytes=segment_bytes) == expected
    chunk = read_chunk(index_chunk_path(tmp_path, "orders", 0))
    assert chunk is not None
    assert chunk.seal_matches()
    assert chunk.sealed_crc != 0


def test_retention_deletes_index_chunks_with_their_segments(tmp_path: Path) -> None:
    clock = SkewedClock()

    async def scenario() -> tuple[SubjectStats, SubjectStats]:
        config = BrokerConfig(
            data_dir=tmp_path, segment_bytes=256 * 1024, retention_s=3600, dedup_window_s=60
        )
        broker = Broker(config, metrics=BrokerMetrics(), clock=clock)
        await broker.start()
        try:
            await fill(broker)
            before = broker.services.stats.subject("orders")
            clock.skew_us = 2 * 3600 * 1_000_000
            await broker.services.maintenance.apply_retention()
            trimmed = subjects_of(broker)["orders"].stats()
            assert trimmed.first_seq > 2 * INDEX_CHUNK_ENTRIES  # all but the active segment
            assert trimmed.bytes < before.bytes
            # a group starting at the earliest seq starts at the first one retained
            pulled, _ = await broker.services.delivery.ack_and_pull(
                ack=None,
                subject="orders",
                group="late",
                consumer="c",
                max_messages=1,
                wait_ms=0,
                mode="shared",
                start="earliest",
            )
            assert pulled[0]["seq"] == trimmed.first_seq
            return before, trimmed
        finally:
            await broker.close()

    _before, trimmed = asyncio.run(scenario())
    assert list_index_chunks(tmp_path, "orders") == [2 * INDEX_CHUNK_ENTRIES]
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert recovered.subjects["orders"].stats() == trimmed
    assert recovered.problems == []
    recovered.subjects.reader.close()
    assert counted_from_scratch(tmp_path, tmp_path.parent / "copy") == trimmed


def make_format_1(data_dir: Path) -> bytes:
    """Turn a data dir this broker wrote back into format 1: one index file per subject,
    checkpoints whose digests are a CRC of the whole index. Returns the old index file."""
    entries = b"".join(
        read_chunk(index_chunk_path(data_dir, "orders", start)).entries  # type: ignore[union-attr]
        for start in list_index_chunks(data_dir, "orders")
    )
    shutil.rmtree(data_dir / "index" / "orders")
    old = INDEX_HEADER.pack(INDEX_MAGIC, 1, INDEX_ENTRY_SIZE, 0) + entries
    (data_dir / "index" / "orders.idx").write_bytes(old)
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        path = data_dir / name
        body = orjson.loads(path.read_bytes())["checkpoint"]
        count = body["indexes"]["orders"][0]
        covered = entries[: count * INDEX_ENTRY_SIZE]
        body = {**body, "format": 1, "indexes": {"orders": [count, zlib.crc32(covered)]}}
        raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        path.write_bytes(b'{"crc32":%d,"checkpoint":%s}' % (zlib.crc32(raw), raw))
    (data_dir / "FORMAT").write_bytes(b'{"format": 1}')
    return old


async def resend_and_read(broker: Broker) -> list[Any]:
    again = await broker.services.producer.produce([incoming(i, body=body(i)) for i in (7, 20_000)])
    reads = [await read_seq(broker, seq) for seq in (0, 20_000, TOTAL - 1)]
    return [(a["status"], a["seq"]) for a in again] + [(r["seq"], r["id"]) for r in reads]


EXPECTED = [
    ("duplicate", 7),
    ("duplicate", 20000),
    (0, "m-0"),
    (20000, "m-20000"),
    (TOTAL - 1, f"m-{TOTAL - 1}"),
]


def test_a_format_1_data_dir_is_migrated_on_start(tmp_path: Path) -> None:
    run_broker(tmp_path, fill)
    run_broker(tmp_path, lambda b: asyncio.sleep(0))  # a second checkpoint, the previous one
    make_format_1(tmp_path)
    assert run_broker(tmp_path, resend_and_read) == EXPECTED
    assert orjson.loads((tmp_path / "FORMAT").read_bytes()) == {"format": FORMAT_VERSION}
    assert not (tmp_path / "index" / "orders.idx").exists()
    assert list_index_chunks(tmp_path, "orders") == [
        0,
        INDEX_CHUNK_ENTRIES,
        2 * INDEX_CHUNK_ENTRIES,
    ]
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert recovered.problems == []
    recovered.subjects.reader.close()


def test_a_damaged_format_1_index_is_rebuilt_from_the_log_when_migrated(tmp_path: Path) -> None:
    run_broker(tmp_path, fill)
    run_broker(tmp_path, lambda b: asyncio.sleep(0))
    old = bytearray(make_format_1(tmp_path))
    old[INDEX_HEADER.size + 3 * INDEX_ENTRY_SIZE + 8] ^= 1  # seq 3's offset
    (tmp_path / "index" / "orders.idx").write_bytes(old)
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert any("rebuilt from the log" in p for p in recovered.problems)
    recovered.subjects.reader.close()
    assert run_broker(tmp_path, resend_and_read) == EXPECTED


def test_a_chunk_that_just_filled_is_read_from_memory_until_all_of_it_is_visible(
    tmp_path: Path,
) -> None:
    """Seqs of a full chunk whose last entries are still being written are not read from
    its file (the first read of a file checks its seal: an unfinished file would look
    damaged)."""
    reader = ChunkReader(tmp_path)  # no chunk file exists at all
    table = SubjectTable(reader, dedup_dir=tmp_path / "dedup", dedup_flush_at=1000)
    for seq in range(INDEX_CHUNK_ENTRIES + 10):
        table.append(
            "orders", [INDEX_ENTRY.pack(0, 40, 16 + 40 * seq, seq, seq)], [seq], framed_bytes=40
        )
    table.make_visible("orders", 100)  # the rest of the chunk is still in flight
    assert table["orders"].raw(5) == (0, 40, 16 + 200, 5, 5)
    assert table["orders"].positions([5, INDEX_CHUNK_ENTRIES + 1]) == [
        (0, 16 + 200, 40),
        (0, 16 + 40 * (INDEX_CHUNK_ENTRIES + 1), 40),
    ]
    table.make_visible("orders", INDEX_CHUNK_ENTRIES + 10)
    with pytest.raises(StorageError, match="is gone"):
        table["orders"].raw(5)  # all visible: the file serves it (here: there is none)
    table.close()


def test_one_append_across_a_chunk_edge_fills_one_chunk_and_opens_the_next(
    tmp_path: Path,
) -> None:
    table = SubjectTable(ChunkReader(tmp_path), dedup_dir=tmp_path / "dedup", dedup_flush_at=1000)

    def entry(seq: int) -> bytes:
        return INDEX_ENTRY.pack(0, 40, 16 + 40 * seq, seq, 10_000 + seq)

    first = table.append(
        "orders", [entry(s) for s in range(100)], list(range(100)), framed_bytes=4000
    )
    seqs = range(100, INDEX_CHUNK_ENTRIES + 20)
    second = table.append(
        "orders", [entry(s) for s in seqs], [10_000 + s for s in seqs], framed_bytes=40 * len(seqs)
    )
    assert (first, second) == (0, 100)
    log = table["orders"]
    assert log.next_seq == INDEX_CHUNK_ENTRIES + 20
    assert log.stats().bytes == 40 * (INDEX_CHUNK_ENTRIES + 20)
    table.make_visible("orders", 50)  # the filled chunk is still served from memory
    assert log.raw(INDEX_CHUNK_ENTRIES - 1) == (
        0,
        40,
        16 + 40 * (INDEX_CHUNK_ENTRIES - 1),
        INDEX_CHUNK_ENTRIES - 1,
        10_000 + INDEX_CHUNK_ENTRIES - 1,
    )
    assert log.raw(INDEX_CHUNK_ENTRIES + 19)[4] == 10_000 + INDEX_CHUNK_ENTRIES + 19
    assert log.seqs_of([10_000 + INDEX_CHUNK_ENTRIES + 5, 3]) == [INDEX_CHUNK_ENTRIES + 5, 3]
    assert table.appended == INDEX_CHUNK_ENTRIES + 20
    table.close()
