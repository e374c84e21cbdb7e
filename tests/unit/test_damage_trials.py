"""Random damage, seeded: the storage-integrity properties hold after every restart.

Each trial writes a real data dir in two sessions (the second one "crashes": its checkpoint
is replaced by the first session's, so its records lie past the checkpoint), damages it one
random way, restarts and checks:
- every message whose frame is intact is served to a new group exactly once, with its body;
- the old group gets again only what it never acked, or what a damaged action record held;
- a seq any group already read is never handed out again;
- a resend of an intact stored message is answered ``duplicate``, never stored again;
- recovery either succeeds or the damage is one it must refuse (then ``on_damage=skip``).
Kinds: bit flips in message, action and index files and in the checkpoint; the last message
segment cut at a random offset; a middle segment removed; a segment replaced by an older
copy of itself (a restored backup).
Reproduce a failure with its seed: ``pytest tests/unit/test_damage_trials.py -k "seed-17"``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from qmq_broker.engine import Broker
from qmq_broker.format import (
    HEADER_SIZE,
    ActionRecord,
    SegmentKind,
    iter_frames,
    list_segments,
    segment_number,
)
from qmq_broker.format.frames import FRAME_SIZE
from qmq_broker.format.index import index_chunk_path
from qmq_broker.recovery.recover import recover
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE
from tests.unit.test_damage import BATCH, drain, flip, message, pull, run_broker

KINDS = (
    "message bit",
    "action bit",
    "index bit",
    "truncate messages",
    "checkpoint bit",
    "lost segment",
    "older backup",
)
FIRST = 300  # messages of the first session; the second adds SECOND more
SECOND = 100


def body(i: int) -> str:
    return f"body {i}".ljust(120, ".")


def write(data_dir: Path) -> set[int]:
    """Two sessions; returns the seqs group ``g`` acked."""
    acked: set[int] = set()

    async def ack_some(broker: Broker, batches: int) -> None:
        for _ in range(batches):
            batch = await pull(broker, "g")
            seqs = [m["seq"] for m in batch]
            await broker.services.delivery.ack(subject="orders", group="g", consumer="c", seqs=seqs)
            acked.update(seqs)

    async def first(broker: Broker) -> None:
        for start in range(0, FIRST, BATCH):
            await broker.services.producer.produce(
                [message(i) for i in range(start, start + BATCH)]
            )
        await ack_some(broker, 3)
        await pull(broker, "g")  # leased, never acked

    async def second(broker: Broker) -> None:
        for start in range(FIRST, FIRST + SECOND, BATCH):
            await broker.services.producer.produce(
                [message(i) for i in range(start, start + BATCH)]
            )
        await ack_some(broker, 1)

    run_broker(data_dir, first)
    saved = data_dir.parent / "saved"
    saved.mkdir()
    shutil.copytree(data_dir / "messages", saved / "messages")
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
        if (data_dir / name).exists():
            shutil.copy(data_dir / name, saved / name)
    run_broker(data_dir, second)
    for name in (CHECKPOINT_FILE, PREVIOUS_FILE):  # the second session's checkpoints never were
        (data_dir / name).unlink(missing_ok=True)
        if (saved / name).exists():
            shutil.copy(saved / name, data_dir / name)
    return acked


def frames(path: Path) -> list[tuple[int, int]]:
    """(start, end) of every frame of a segment."""
    return [
        (offset, offset + FRAME_SIZE + len(payload))
        for offset, payload in iter_frames(path.read_bytes(), path=str(path))
    ]


def damage(data_dir: Path, kind: str, rng: random.Random) -> tuple[set[int], set[int]]:
    """Damage one way; returns (seqs whose frame is no longer intact, seqs whose action
    record was damaged)."""
    subject = recover(data_dir, dedup_window_s=3600).subjects["orders"]
    where = {seq: subject.raw(seq)[:3] for seq in range(subject.next_seq)}

    def seqs_in(segment: int, start: int, end: int) -> set[int]:
        return {
            seq
            for seq, (seg, length, offset) in where.items()
            if seg == segment and offset < end and offset + length > start
        }

    messages = list_segments(data_dir, SegmentKind.MESSAGES)
    if kind == "message bit":
        path = rng.choice(messages)
        offset = rng.randrange(HEADER_SIZE, path.stat().st_size)
        flip(path, offset, rng.randrange(8))
        return seqs_in(segment_number(path), offset, offset + 1), set()
    if kind == "truncate messages":
        path = messages[-1]
        cut = rng.randrange(HEADER_SIZE, path.stat().st_size)
        with open(path, "r+b") as handle:
            handle.truncate(cut)
        return seqs_in(segment_number(path), cut, path.stat().st_size + 10**9), set()
    if kind == "older backup":  # the segment the first session ended in, as it was then
        old = sorted((data_dir.parent / "saved" / "messages").glob("*.seg"))[-1]
        path = data_dir / "messages" / old.name
        shutil.copy(old, path)
        return seqs_in(segment_number(path), old.stat().st_size, 10**12), set()
    if kind == "lost segment":
        path = messages[rng.randrange(1, len(messages) - 1)]
        path.unlink()
        return seqs_in(segment_number(path), 0, 10**12), set()
    if kind == "index bit":
        path = index_chunk_path(data_dir, "orders", 0)
        flip(path, rng.randrange(path.stat().st_size), rng.randrange(8))
        return set(), set()
    if kind == "checkpoint bit":
        path = data_dir / CHECKPOINT_FILE
        flip(path, rng.randrange(path.stat().st_size), rng.randrange(8))
        return set(), set()
    actions = list_segments(data_dir, SegmentKind.ACTIONS)
    path = rng.choice(actions)
    offset = rng.randrange(HEADER_SIZE, path.stat().st_size)
    hit: set[int] = set()
    data = path.read_bytes()
    for start, end in frames(path):
        if start <= offset < end:
            hit = set(ActionRecord.decode(data[start + FRAME_SIZE : end]).seqs)
    flip(path, offset, rng.randrange(8))
    return set(), hit


def check(data_dir: Path, acked: set[int], broken: set[int], lost_changes: set[int]) -> None:
    total = FIRST + SECOND

    async def after(broker: Broker) -> dict[str, Any]:
        seen_before = max(broker.services.stats.subject("orders").groups[0].backlog, 0)
        again = await drain(broker, "g")
        fresh = await drain(broker, "fresh")
        stored = await broker.services.producer.produce([message(10**6)])
        resent = await broker.services.producer.produce([message(i) for i in range(0, total, 7)])
        return {
            "again": again,
            "fresh": fresh,
            "stored": stored,
            "resent": resent,
            "backlog": seen_before,
        }

    result = run_broker(data_dir, after, on_damage="skip")
    fresh_ids = [m["id"] for m in result["fresh"]]
    assert len(fresh_ids) == len(set(fresh_ids)), "served twice"
    for m in result["fresh"] + result["again"]:
        assert m["body"] == body(int(m["id"][2:])), "a corrupt or foreign body was served"
    intact = {f"m-{i}" for i in range(total)} - {f"m-{i}" for i in broken}
    assert intact <= set(fresh_ids), f"intact messages not served: {intact - set(fresh_ids)}"
    again = {m["seq"] for m in result["again"]}
    assert not (again & acked - lost_changes), f"acked messages redelivered: {again & acked}"
    stored_twice = [
        r["id"] for r in result["resent"] if r["status"] == "stored" and r["id"] in intact
    ]
    assert not stored_twice, f"a resend of a stored message was stored again: {stored_twice}"
    read_by_g = max(acked | again, default=-1)
    assert result["stored"][0]["seq"] > read_by_g, "a seq a group read was handed out again"


def trial(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    acked = write(data_dir)
    kind = rng.choice(KINDS)
    broken, lost_changes = damage(data_dir, kind, rng)
    print(f"seed {seed}: {kind}; frames hit {sorted(broken)}; action seqs hit {len(lost_changes)}")
    check(data_dir, acked, broken, lost_changes)


@pytest.mark.parametrize("seed", range(50), ids=lambda s: f"seed-{s}")
def test_random_damage(tmp_path: Path, seed: int) -> None:
    trial(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1000, 2000), ids=lambda s: f"seed-{s}")
def test_random_damage_thousand(tmp_path: Path, seed: int) -> None:
    trial(tmp_path, seed)
