"""Damaged files on a real data directory: a flipped bit costs the record it hit, nothing more.

A broker writes real files; the test removes the checkpoint (so everything is "after the
checkpoint", as after a crash), flips one bit, restarts the broker and drains the subject
with a new group. Property: every message whose frame is intact is served exactly once, the
damaged one is dead-lettered as ``unreadable record`` and never served, and seqs are not
reused. Action-log damage costs only the group changes in the damaged record.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from qmq_broker.engine import Broker
from qmq_broker.errors import StorageError
from qmq_broker.format import (
    ActionType,
    SegmentKind,
    iter_action_records,
    list_segments,
    segment_number,
)
from qmq_broker.format.index import index_chunk_path
from qmq_broker.messages import IncomingMessage
from qmq_broker.recovery.recover import recover
from qmq_broker.storage.segments import segment_path
from tests.support.engine import incoming
from tests.support.engine import run_broker as engine_run

MESSAGES = 300
BATCH = 50


def message(i: int) -> IncomingMessage:
    return incoming(i, body=f"body {i}".ljust(120, ".").encode())


def run_broker(data_dir: Path, script: Any, **config: Any) -> Any:
    """Small segments, so a few hundred messages span several."""
    return engine_run(data_dir, script, segment_bytes=8192, **config)


async def produce_all(broker: Broker) -> None:
    for start in range(0, MESSAGES, BATCH):
        results = await broker.services.producer.produce(
            [message(i) for i in range(start, start + BATCH)]
        )
        assert {r["status"] for r in results} == {"stored"}


async def pull(broker: Broker, group: str) -> list[dict[str, Any]]:
    messages, _ = await broker.services.delivery.ack_and_pull(
        ack=None,
        subject="orders",
        group=group,
        consumer="c",
        max_messages=BATCH,
        wait_ms=0,
        mode="shared",
        start="earliest",
    )
    return list(messages)


async def drain(broker: Broker, group: str) -> list[dict[str, Any]]:
    """Pull and ack everything a new group can get."""
    served: list[dict[str, Any]] = []
    while batch := await pull(broker, group):
        served.extend(batch)
        seqs = [m["seq"] for m in batch]
        await broker.services.delivery.ack(subject="orders", group=group, consumer="c", seqs=seqs)
    return served


def crash_before_checkpoint(data_dir: Path, *, keep_index: bool) -> None:
    """As if the broker died before its first checkpoint (and, optionally, its index)."""
    (data_dir / "checkpoint.json").unlink()
    if not keep_index:
        shutil.rmtree(data_dir / "index")


def flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def frame_of(data_dir: Path, seq: int) -> tuple[Path, int, int]:
    """(segment file, frame offset, frame length) of a stored seq, from the index."""
    segment, length, offset, _, _ = (
        recover(data_dir, dedup_window_s=3600).subjects["orders"].raw(seq)
    )
    return segment_path(data_dir, SegmentKind.MESSAGES, segment), offset, length


def check_served_around(
    data_dir: Path, damaged: set[int], *, repaired: bool = False, **config: Any
) -> None:
    """Drain a new group after a restart and check the damage cost only ``damaged``;
    ``repaired``: an earlier ``recover()`` already fixed what this start would report."""

    async def after(broker: Broker) -> tuple[list[dict[str, Any]], Any, list[dict[str, Any]]]:
        served = await drain(broker, "fresh")
        dead = broker.services.delivery.dead_letters(
            subject="orders", group="fresh", limit=1000, after_seq=None
        )
        again = await broker.services.producer.produce([message(MESSAGES)])
        registry = broker.metrics.registry
        assert registry.get_sample_value("qmq_broker_unreadable_messages_total") == len(damaged)
        assert registry.get_sample_value("qmq_broker_recovery_problems") >= (0 if repaired else 1)
        return served, dead, list(again)

    served, dead, again = run_broker(data_dir, after, **config)
    ids = [m["id"] for m in served]
    assert len(ids) == len(set(ids)), "a message was served twice"
    assert set(ids) == {f"m-{i}" for i in range(MESSAGES)} - {f"m-{i}" for i in damaged}
    assert all(m["body"] == f"body {m['seq']}".ljust(120, ".") for m in served)
    assert {d.seq for d in dead.dead} == damaged
    assert {d.error for d in dead.dead} <= {"unreadable record"}
    assert again[0]["seq"] == MESSAGES, "a seq was reused"


@pytest.mark.parametrize("keep_index", [True, False], ids=["index kept", "index rebuilt"])
@pytest.mark.parametrize("where", ["last segment", "earlier segment"])
def test_a_flipped_bit_costs_only_the_message_it_hit(
    tmp_path: Path, where: str, keep_index: bool
) -> None:
    run_broker(tmp_path, produce_all)
    victim = MESSAGES - 3 if where == "last segment" else 40
    path, offset, length = frame_of(tmp_path, victim)
    last = list_segments(tmp_path, SegmentKind.MESSAGES)[-1]
    assert (path == last) == (where == "last segment")
    crash_before_checkpoint(tmp_path, keep_index=keep_index)
    flip(path, offset + length // 2)
    check_served_around(tmp_path, {victim})


def test_a_flipped_length_field_is_resynchronised_past(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_all)
    path, offset, _ = frame_of(tmp_path, 150)
    crash_before_checkpoint(tmp_path, keep_index=False)
    flip(path, offset + 1, bit=3)  # the frame now claims to be 2 KiB longer
    check_served_around(tmp_path, {150})


def test_a_torn_tail_is_still_truncated(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_all)
    last = list_segments(tmp_path, SegmentKind.MESSAGES)[-1]
    path, offset, _ = frame_of(tmp_path, MESSAGES - 1)
    assert path == last
    crash_before_checkpoint(tmp_path, keep_index=False)
    with open(last, "r+b") as handle:
        handle.truncate(offset + 10)  # the last frame was half written
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert recovered.subjects["orders"].next_seq == MESSAGES - 1
    assert last.stat().st_size == offset
    assert any("truncated" in problem for problem in recovered.problems)


@pytest.mark.parametrize("seed", range(20))
def test_random_bit_flips_in_message_segments(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    run_broker(tmp_path, produce_all)
    crash_before_checkpoint(tmp_path, keep_index=rng.random() < 0.5)
    segments = list_segments(tmp_path, SegmentKind.MESSAGES)
    path = rng.choice(segments)
    offset = rng.randrange(16, path.stat().st_size)  # past the segment header
    flip(path, offset, bit=rng.randrange(8))
    recovered = recover(tmp_path, dedup_window_s=3600)
    subject = recovered.subjects["orders"]
    number = segment_number(path)
    damaged = {
        seq
        for seq in range(subject.next_seq)
        if subject.raw(seq)[0] == number
        and subject.raw(seq)[2] <= offset < subject.raw(seq)[2] + subject.raw(seq)[1]
    }
    print(f"seed {seed}: bit flipped in {path.name} at {offset}; damaged seqs {damaged}")
    check_served_around(tmp_path, damaged)


def test_a_damaged_ack_record_costs_only_its_own_acks(tmp_path: Path) -> None:
    async def consume(broker: Broker) -> None:
        await produce_all(broker)
        await drain(broker, "g")  # six lease records and six ack records of 50 seqs

    run_broker(tmp_path, consume, ack_timeout_s=0.2)
    crash_before_checkpoint(tmp_path, keep_index=True)
    acks = [
        (path, offset, record)
        for path in list_segments(tmp_path, SegmentKind.ACTIONS)
        for offset, record in iter_action_records(path)
        if record.type is ActionType.ACK
    ]
    assert len(acks) == MESSAGES // BATCH
    path, offset, record = acks[1]
    flip(path, offset + 12)
    lost = set(record.seqs)

    async def after(broker: Broker) -> list[dict[str, Any]]:
        await asyncio.sleep(0.3)  # the leases of the lost acks run out
        return await drain(broker, "g")

    redelivered = run_broker(tmp_path, after, ack_timeout_s=0.2)
    assert {m["seq"] for m in redelivered} == lost


def test_a_segment_cut_below_the_checkpoint_reuses_no_seq(tmp_path: Path) -> None:
    async def consume(broker: Broker) -> None:
        await produce_all(broker)
        await drain(broker, "g")  # the group's cursor is past every seq

    run_broker(tmp_path, consume)  # closing writes a checkpoint past everything
    last = list_segments(tmp_path, SegmentKind.MESSAGES)[-1]
    first_cut, offset, _ = frame_of(tmp_path, MESSAGES - 2)
    assert first_cut == last
    with open(last, "r+b") as handle:
        handle.truncate(offset)  # the last two records are gone (say, an older backup)

    async def after(broker: Broker) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any]:
        stored = await broker.services.producer.produce([message(MESSAGES)])
        new = await drain(broker, "g")
        fresh = await drain(broker, "fresh")
        dead = broker.services.delivery.dead_letters(
            subject="orders", group="fresh", limit=1000, after_seq=None
        )
        return list(stored), new, (fresh, dead)

    stored, new, (fresh, dead) = run_broker(tmp_path, after)
    assert stored[0]["seq"] == MESSAGES  # not MESSAGES - 2: no seq is reused
    assert [m["id"] for m in new] == [f"m-{MESSAGES}"]  # the old group sees the new message
    assert {m["seq"] for m in fresh} == set(range(MESSAGES + 1)) - {MESSAGES - 2, MESSAGES - 1}
    assert {d.seq for d in dead.dead} == {MESSAGES - 2, MESSAGES - 1}


@pytest.mark.parametrize("keep_index", [True, False], ids=["index kept", "index rebuilt"])
def test_a_missing_middle_segment_fails_recovery_unless_skipped(
    tmp_path: Path, keep_index: bool
) -> None:
    run_broker(tmp_path, produce_all)
    if not keep_index:
        crash_before_checkpoint(tmp_path, keep_index=False)
    segments = list_segments(tmp_path, SegmentKind.MESSAGES)
    missing = segments[len(segments) // 2]
    subject = recover(tmp_path, dedup_window_s=3600).subjects["orders"]
    lost = {seq for seq in range(MESSAGES) if subject.raw(seq)[0] == segment_number(missing)}
    missing.unlink()
    with pytest.raises(StorageError, match=r"missing between others; restore them, or start"):
        recover(tmp_path, dedup_window_s=3600)
    assert lost
    check_served_around(tmp_path, lost, on_damage="skip")


def test_an_unreadable_segment_header_fails_recovery_unless_skipped(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_all)
    crash_before_checkpoint(tmp_path, keep_index=True)
    middle = list_segments(tmp_path, SegmentKind.MESSAGES)[2]
    data = bytearray(middle.read_bytes())
    data[0:6] = b"BROKEN"  # the magic; every frame after it is intact
    middle.write_bytes(bytes(data))
    with pytest.raises(StorageError, match=r"bad magic.*start with --on-damage skip"):
        recover(tmp_path, dedup_window_s=3600)
    check_served_around(tmp_path, set(), on_damage="skip")


@pytest.mark.parametrize("field", ["segment", "offset", "id hash"])
def test_a_damaged_index_is_rebuilt_from_the_log(tmp_path: Path, field: str) -> None:
    run_broker(tmp_path, produce_all)  # closing writes a checkpoint with the index digests
    index = index_chunk_path(tmp_path, "orders", 0)
    entry = 16 + 123 * 32  # seq 123's entry, past the 16-byte header
    flip(index, entry + {"segment": 0, "offset": 8, "id hash": 24}[field], bit=2)
    problems = recover(tmp_path, dedup_window_s=3600).problems
    assert [p for p in problems if "rebuilt from the log" in p] != []
    check_served_around(tmp_path, set(), repaired=True)

    async def resend(broker: Broker) -> list[dict[str, Any]]:
        return list(await broker.services.producer.produce([message(123)]))

    assert run_broker(tmp_path, resend)[0]["status"] == "duplicate"


def test_an_index_entry_past_the_checkpoint_is_corrected_from_the_log(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_all)
    crash_before_checkpoint(tmp_path, keep_index=True)
    index = index_chunk_path(tmp_path, "orders", 0)
    flip(index, 16 + 200 * 32 + 24, bit=5)  # seq 200's id hash
    problems = recover(tmp_path, dedup_window_s=3600).problems
    assert [p for p in problems if "seq 200 corrected from the log" in p] != []

    async def resend(broker: Broker) -> list[dict[str, Any]]:
        return list(await broker.services.producer.produce([message(200)]))

    assert run_broker(tmp_path, resend)[0]["status"] == "duplicate"
    check_served_around(tmp_path, set(), repaired=True)


def test_a_rebuilt_index_keeps_every_seq_the_checkpoint_covered(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_all)  # no group: only the checkpoint knows the seqs
    last = list_segments(tmp_path, SegmentKind.MESSAGES)[-1]
    _, offset, _ = frame_of(tmp_path, MESSAGES - 2)
    with open(last, "r+b") as handle:
        handle.truncate(offset)  # the last two records are gone
    flip(index_chunk_path(tmp_path, "orders", 0), 16 + 5 * 32 + 24)  # and the index is damaged
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert recovered.subjects["orders"].next_seq == MESSAGES
    assert [p for p in recovered.problems if "rebuilt from the log" in p] != []
    check_served_around(tmp_path, {MESSAGES - 2, MESSAGES - 1}, repaired=True)
