"""Checkpoints: a CRC over canonical bytes, kept in pairs, a damaged one passed over."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from qmq_broker.engine import Broker
from qmq_broker.errors import StorageError
from qmq_broker.format import FORMAT_VERSION
from qmq_broker.recovery.migrate import migrate
from qmq_broker.recovery.recover import recover
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE, Checkpoint
from tests.support.engine import incoming, run_broker

GROUPS = {"orders": {"g": {"mode": "shared", "states": {"": {"cursor": 7}}}}}


def sample(cursor_at: int = 1000) -> Checkpoint:
    return Checkpoint(
        messages_at=(3, cursor_at), actions_at=(1, 64), groups=GROUPS, written_at_us=42
    )


def test_encode_decode_round_trip() -> None:
    assert Checkpoint.decode(sample().encode(), path="c") == sample()


def test_an_edited_field_fails_the_crc() -> None:
    edited = sample().encode().replace(b'"cursor":7', b'"cursor":9')
    with pytest.raises(StorageError, match="CRC mismatch"):
        Checkpoint.decode(edited, path="c")


def test_a_checkpoint_of_the_first_layout_is_migrated_and_then_read(tmp_path: Path) -> None:
    """Format 1 without a CRC (the first layout): the start of a format-2 broker rewrites
    it with a CRC, its contents unchanged."""
    legacy = orjson.dumps(
        {
            "format": 1,
            "messages_at": [3, 1000],
            "actions_at": [1, 64],
            "groups": GROUPS,
            "written_at_us": 42,
        }
    )
    with pytest.raises(StorageError, match="unsupported format 1"):
        Checkpoint.decode(legacy, path="c")
    (tmp_path / CHECKPOINT_FILE).write_bytes(legacy)
    migrate(tmp_path, 1)
    assert Checkpoint.load(tmp_path) == sample()
    assert orjson.loads((tmp_path / "FORMAT").read_bytes()) == {"format": FORMAT_VERSION}


def test_writing_keeps_the_previous_and_loading_falls_back_to_it(tmp_path: Path) -> None:
    sample(1000).write(tmp_path)
    sample(2000).write(tmp_path)
    assert Checkpoint.load(tmp_path).messages_at == (3, 2000)
    assert Checkpoint.decode((tmp_path / PREVIOUS_FILE).read_bytes(), path="p").messages_at == (
        3,
        1000,
    )
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"{not json")
    problems: list[str] = []
    assert Checkpoint.load(tmp_path, problems).messages_at == (3, 1000)
    assert len(problems) == 1
    assert "passed over" in problems[0]
    (tmp_path / PREVIOUS_FILE).write_bytes(b"")
    problems.clear()
    assert Checkpoint.load(tmp_path, problems) == Checkpoint()
    assert "rebuilt from the logs" in problems[-1]


def test_a_crash_between_the_two_renames_leaves_the_previous(tmp_path: Path) -> None:
    sample(1000).write(tmp_path)
    sample(2000).write(tmp_path)
    (tmp_path / CHECKPOINT_FILE).unlink()  # as if the second rename never happened
    assert Checkpoint.load(tmp_path).messages_at == (3, 1000)


@pytest.mark.parametrize("damaged", [[CHECKPOINT_FILE], [CHECKPOINT_FILE, PREVIOUS_FILE]])
def test_recovery_passes_over_a_damaged_checkpoint(tmp_path: Path, damaged: list[str]) -> None:
    async def work(broker: Broker) -> None:
        await broker.services.producer.produce([incoming(i) for i in range(30)])
        pulled, _ = await broker.services.delivery.ack_and_pull(
            ack=None,
            subject="orders",
            group="g",
            consumer="c",
            max_messages=20,
            wait_ms=0,
            mode="shared",
            start="earliest",
        )
        await broker.services.maintenance.checkpoint()  # the previous: before the ack
        seqs = [m["seq"] for m in pulled[:10]]
        await broker.services.delivery.ack(subject="orders", group="g", consumer="c", seqs=seqs)

    run_broker(tmp_path, work)  # closing writes the current one
    expected = recover(tmp_path, dedup_window_s=3600).groups[("orders", "g")].snapshot()
    for name in damaged:
        data = bytearray((tmp_path / name).read_bytes())
        data[len(data) // 2] ^= 0x04
        (tmp_path / name).write_bytes(bytes(data))
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert recovered.groups[("orders", "g")].snapshot() == expected
    assert recovered.subjects["orders"].next_seq == 30
    assert sum("passed over" in p for p in recovered.problems) == len(damaged)
