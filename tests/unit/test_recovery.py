"""Recovery on real files: torn tails, index rebuild and trim, group-state replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qmq_broker.engine import Broker
from qmq_broker.format import HEADER_SIZE, SegmentKind, list_segments
from qmq_broker.format.frames import frame
from qmq_broker.format.ids import id_hash
from qmq_broker.format.index import index_chunk_path
from qmq_broker.messages import IncomingMessage
from qmq_broker.recovery.recover import recover
from tests.support.engine import run_broker as engine_run


def message(i: int, subject: str = "orders") -> IncomingMessage:
    return IncomingMessage(
        id=f"m-{i}",
        subject=subject,
        key=None,
        headers={},
        body=f"body {i}".ljust(200, ".").encode(),
        body_base64=False,
        producer="test",
        created_at_us=None,
        deliver_at_us=0,
    )


def run_broker(data_dir: Path, script: Any) -> Any:
    return engine_run(data_dir, script, segment_bytes=4096)


async def produce_pull_ack(broker: Broker) -> dict[str, Any]:
    await broker.services.producer.produce([message(i) for i in range(40)])
    await broker.services.producer.produce([message(i, "payments") for i in range(5)])
    pulled, _ = await broker.services.delivery.ack_and_pull(
        ack=None,
        subject="orders",
        group="g",
        consumer="c",
        max_messages=10,
        wait_ms=0,
        mode="shared",
        start="earliest",
    )
    await broker.services.delivery.ack(
        subject="orders", group="g", consumer="c", seqs=[m["seq"] for m in pulled[:6]]
    )
    await broker.services.delivery.nack(
        subject="orders", group="g", consumer="c", seqs=[6, 7], delay_ms=60_000, error="later"
    )
    return broker.services.stats.subject("orders")


def test_torn_tail_is_truncated_and_whole_records_kept(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_pull_ack)
    last = list_segments(tmp_path, SegmentKind.MESSAGES)[-1]
    size = last.stat().st_size
    with open(last, "ab") as handle:
        handle.write(frame(b"x" * 100)[:-7])
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert last.stat().st_size == size
    assert any("truncated" in p for p in recovered.problems)
    assert recovered.subjects["orders"].next_seq == 40
    assert recovered.messages_at == (int(last.name[:20]), size)


def test_index_is_rebuilt_from_the_log_when_lost(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_pull_ack)
    original = index_chunk_path(tmp_path, "orders", 0).read_bytes()
    index_chunk_path(tmp_path, "orders", 0).unlink()
    (tmp_path / "checkpoint.json").unlink()
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert recovered.subjects["orders"].next_seq == 40
    assert index_chunk_path(tmp_path, "orders", 0).read_bytes() == original
    orders = recovered.subjects["orders"]
    assert [orders.seq_of(id_hash(f"m-{i}")) for i in range(40)] == list(range(40))
    assert len(list_segments(tmp_path, SegmentKind.MESSAGES)) > 1  # rolled at 4 KiB


def test_index_entries_past_the_log_keep_their_seqs_and_are_counted(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_pull_ack)
    index = index_chunk_path(tmp_path, "payments", 0)
    data = index.read_bytes()
    index.write_bytes(data + data[-32:].replace(b"\x00", b"\x7f"))  # points past every segment
    recovered = recover(tmp_path, dedup_window_s=3600)
    assert recovered.subjects["payments"].next_seq == 6  # seq 5 is never handed out again
    assert recovered.lost == {"payments": 1}
    assert any("payments: 1 stored messages lost, seqs 5" in p for p in recovered.problems)


def test_group_state_replays_from_the_action_log(tmp_path: Path) -> None:
    stats = run_broker(tmp_path, produce_pull_ack)
    with_checkpoint = recover(tmp_path, dedup_window_s=3600).groups[("orders", "g")].snapshot()
    (tmp_path / "checkpoint.json").unlink()
    replayed = recover(tmp_path, dedup_window_s=3600).groups[("orders", "g")].snapshot()
    assert replayed == with_checkpoint
    group = stats.groups[0]
    assert (group.acked, group.in_flight, group.retrying, group.backlog) == (
        6,
        2,
        2,
        30,
    )


def test_restarted_broker_dedups_and_continues_seqs(tmp_path: Path) -> None:
    run_broker(tmp_path, produce_pull_ack)

    async def again(broker: Broker) -> list[dict[str, Any]]:
        return await broker.services.producer.produce([message(3), message(99)])

    results = run_broker(tmp_path, again)
    assert [(r["status"], r["seq"]) for r in results] == [("duplicate", 3), ("stored", 40)]


def test_empty_data_dir_recovers_to_nothing(tmp_path: Path) -> None:
    recovered = recover(tmp_path / "new", dedup_window_s=1)
    assert recovered.subjects == {}
    assert recovered.messages_at == (0, HEADER_SIZE)
