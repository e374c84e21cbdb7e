"""The scheduler inside a real ``Broker`` on real files, driven by a controllable clock.

The broker's wheel loop runs too, but it only acts on the fake clock, which moves only when
a test moves it; each test then calls ``delayed.step()`` to act on the new time at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from qmq_broker.clock import SystemClock
from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.delayed.recovery import recover_schedule
from qmq_broker.delayed.service import ScheduledCount
from qmq_broker.engine import Broker
from qmq_broker.format import (
    HEADER_SIZE,
    SegmentKind,
    iter_dispatch_records,
    iter_frames,
    iter_message_records,
    list_segments,
    segment_number,
)
from qmq_broker.format.schedule import HOUR_US, hour_bucket
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.storage.segments import segment_path

T = TypeVar("T")
T0 = int(datetime(2030, 1, 1, 10, 30, tzinfo=UTC).timestamp()) * 1_000_000
SECOND = 1_000_000
MINUTE = 60 * SECOND


class FakeClock(SystemClock):
    """Wall time stands at ``now_us`` until a test moves it; pull timers stay real."""

    def __init__(self, now_us: int) -> None:
        self.now_us = now_us

    def wall_us(self) -> int:
        return self.now_us


def delayed(i: int | str, due_us: int, subject: str = "orders") -> IncomingMessage:
    return IncomingMessage(
        id=f"m-{i}",
        subject=subject,
        key=None,
        headers={"n": str(i)},
        body=f"body {i}".encode(),
        body_base64=False,
        producer="test",
        created_at_us=None,
        deliver_at_us=due_us,
    )


def run(
    data_dir: Path, clock: FakeClock, script: Callable[[Broker], Awaitable[T]], **config: Any
) -> T:
    async def main() -> T:
        broker = Broker(
            BrokerConfig(data_dir=data_dir, fsync=FsyncPolicy(mode="always"), **config),
            metrics=BrokerMetrics(),
            clock=clock,
        )
        await broker.start()
        try:
            return await script(broker)
        finally:
            await broker.close()

    return asyncio.run(main())


async def advance(broker: Broker, clock: FakeClock, to_us: int) -> None:
    clock.now_us = to_us
    await broker.services.delayed.step()


async def pull_all(broker: Broker, subject: str = "orders") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while True:
        got, _ = await broker.services.delivery.ack_and_pull(
            ack=None,
            subject=subject,
            group="g",
            consumer="c",
            max_messages=1000,
            wait_ms=0,
            mode="shared",
            start="earliest",
        )
        if not got:
            return out
        await broker.services.delivery.ack(
            subject=subject, group="g", consumer="c", seqs=[m["seq"] for m in got]
        )
        out.extend(got)


def stored_ids(data_dir: Path) -> list[str]:
    ids: list[str] = []
    for path in list_segments(data_dir, SegmentKind.MESSAGES):
        ids.extend(record.id for _, record in iter_message_records(path))
    return ids


def test_a_delayed_message_is_scheduled_then_stored_when_due_and_not_before(
    tmp_path: Path,
) -> None:
    clock = FakeClock(T0)

    async def script(broker: Broker) -> None:
        results = await broker.services.producer.produce([delayed(1, T0 + 3 * SECOND)])
        assert results == [{"id": "m-1", "subject": "orders", "status": "scheduled", "seq": None}]
        stats = broker.services.stats.subject("orders")
        assert stats.messages == 0
        assert stats.scheduled.messages == 1
        await advance(broker, clock, T0 + 3 * SECOND - 1)
        assert await pull_all(broker) == []
        await advance(broker, clock, T0 + 3 * SECOND)
        [got] = await pull_all(broker)
        assert (got["id"], got["seq"], got["headers"]) == ("m-1", 0, {"n": "1"})
        assert got["stored_at"] == "2030-01-01T10:30:03.000000Z"
        scheduled = broker.services.stats.subject("orders").scheduled
        assert scheduled == ScheduledCount(messages=0, bytes=0, unreadable=0)
        schedule = broker.services.stats.schedule(limit=10)
        assert schedule.messages == 0
        assert schedule.dispatched == 1
        assert schedule.last_dispatch.lateness_ms == 0

    run(tmp_path, clock, script)
    [path] = list_segments(tmp_path, SegmentKind.MESSAGES)
    [(_, record)] = list(iter_message_records(path))
    assert record.deliver_at_us == T0 + 3 * SECOND


def test_due_order_across_an_hour_boundary_and_within_one_tick(tmp_path: Path) -> None:
    clock = FakeClock(T0 + 29 * MINUTE)  # 10:59
    hour_end = T0 + 30 * MINUTE  # 11:00
    dues = [hour_end + 400_000, hour_end - 1, hour_end, hour_end + 100_000, hour_end - 300_000]

    async def script(broker: Broker) -> list[str]:
        await broker.services.producer.produce([delayed(i, due) for i, due in enumerate(dues)])
        hours = broker.services.stats.schedule(limit=10).hours
        assert [h.messages for h in hours] == [2, 3]
        await advance(broker, clock, hour_end + SECOND)
        return [m["id"] for m in await pull_all(broker)]

    got = run(tmp_path, clock, script)
    assert got == ["m-4", "m-1", "m-2", "m-3", "m-0"]


def test_many_messages_due_in_one_tick_all_go_out_in_due_order(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    due0 = T0 + 10 * SECOND

    async def script(broker: Broker) -> list[dict[str, Any]]:
        # accepted in reverse due order: the last accepted is due first
        for start in range(0, 5000, 1000):
            batch = [delayed(i, due0 + (5000 - i) * 10) for i in range(start, start + 1000)]
            await broker.services.producer.produce(batch)
        assert broker.services.stats.schedule(limit=1).messages == 5000
        await advance(broker, clock, due0 + 400_000)
        return await pull_all(broker)

    got = run(tmp_path, clock, script)
    assert len(got) == 5000
    assert [m["id"] for m in got] == [f"m-{i}" for i in range(4999, -1, -1)]
    assert [m["seq"] for m in got] == list(range(5000))


def test_a_far_future_hour_stays_on_disk_until_its_hour_comes_near(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    far = T0 + 364 * 24 * HOUR_US + 123

    async def script(broker: Broker) -> None:
        await broker.services.producer.produce([delayed("far", far), delayed("soon", T0 + SECOND)])
        await advance(broker, clock, T0 + 2 * SECOND)
        stats = broker.services.stats.schedule(limit=10)
        assert stats.wheel_messages == 0  # the far one is not in memory
        assert stats.next_due_at == "2030-12-31T10:30:00.000123Z"
        assert [h.loaded for h in stats.hours] == [False]
        assert [m["id"] for m in await pull_all(broker)] == ["m-soon"]
        hour_start = hour_bucket(far) * HOUR_US
        await advance(broker, clock, hour_start - 6 * MINUTE)
        assert broker.services.stats.schedule(limit=10).wheel_messages == 0
        await advance(broker, clock, hour_start - 5 * MINUTE)  # the default load-ahead
        assert broker.services.stats.schedule(limit=10).wheel_messages == 1
        await advance(broker, clock, far)
        assert [m["id"] for m in await pull_all(broker)] == ["m-far"]

    run(tmp_path, clock, script)


def test_resent_scheduled_ids_are_duplicates_before_and_after_dispatch(tmp_path: Path) -> None:
    clock = FakeClock(T0)

    async def script(broker: Broker) -> None:
        first = await broker.services.producer.produce(
            [delayed(1, T0 + MINUTE), delayed(1, T0 + MINUTE)]
        )
        assert [r["status"] for r in first] == ["scheduled", "duplicate"]
        again = await broker.services.producer.produce([delayed(1, 0), delayed(1, T0 + 2 * MINUTE)])
        assert [(r["status"], r["seq"]) for r in again] == [("duplicate", None)] * 2
        other_subject = await broker.services.producer.produce(
            [delayed(1, T0 + MINUTE, subject="audit")]
        )
        assert other_subject[0]["status"] == "scheduled"
        await advance(broker, clock, T0 + MINUTE)
        after = await broker.services.producer.produce([delayed(1, T0 + 5 * MINUTE)])
        assert [(r["status"], r["seq"]) for r in after] == [("duplicate", 0)]
        assert len(await pull_all(broker)) == 1

    run(tmp_path, clock, script)


def test_restart_delivers_what_came_due_while_down_exactly_once(tmp_path: Path) -> None:
    clock = FakeClock(T0)

    async def schedule(broker: Broker) -> None:
        await broker.services.producer.produce(
            [delayed(i, T0 + (i + 1) * 10 * MINUTE) for i in range(6)]
        )
        await advance(broker, clock, T0 + 10 * MINUTE)  # m-0 goes out before the "crash"

    run(tmp_path, clock, schedule)
    clock.now_us = T0 + 45 * MINUTE  # m-1 .. m-3 came due while down

    async def after_restart(broker: Broker) -> list[str]:
        assert broker.services.stats.schedule(limit=10).messages == 5
        await broker.services.delayed.step()
        assert broker.services.stats.schedule(limit=10).messages == 2
        dup = await broker.services.producer.produce([delayed(5, T0 + 60 * MINUTE)])
        assert dup[0]["status"] == "duplicate"
        return [m["id"] for m in await pull_all(broker)]

    assert run(tmp_path, clock, after_restart) == ["m-0", "m-1", "m-2", "m-3"]
    clock.now_us = T0 + 2 * HOUR_US

    async def later(broker: Broker) -> list[str]:
        await broker.services.delayed.step()
        return [m["id"] for m in await pull_all(broker)]

    assert run(tmp_path, clock, later) == ["m-4", "m-5"]
    assert sorted(stored_ids(tmp_path)) == [f"m-{i}" for i in range(6)]


def test_a_dispatch_whose_record_was_lost_is_not_stored_twice(tmp_path: Path) -> None:
    clock = FakeClock(T0)

    async def dispatch(broker: Broker) -> None:
        await broker.services.producer.produce([delayed(i, T0 + SECOND) for i in range(3)])
        await advance(broker, clock, T0 + SECOND)

    run(tmp_path, clock, dispatch)
    bucket = hour_bucket(T0)
    dispatch_log = segment_path(tmp_path, SegmentKind.DISPATCH, bucket)
    assert [r.seqs for _, r in iter_dispatch_records(dispatch_log)] == [(0, 1, 2)]
    # a crash after the messages were stored, before their dispatch record reached the disk
    with open(dispatch_log, "r+b") as handle:
        handle.truncate(HEADER_SIZE + 5)  # a torn record
    clock.now_us = T0 + 2 * SECOND

    async def redo(broker: Broker) -> None:
        assert broker.services.stats.schedule(limit=1).messages == 3
        await broker.services.delayed.step()
        assert broker.services.stats.schedule(limit=1).messages == 0
        sample = broker.metrics.registry.get_sample_value
        assert sample("qmq_broker_schedule_redispatched_messages_total") == 3
        assert sample("qmq_broker_schedule_dispatched_messages_total") == 0

    run(tmp_path, clock, redo)
    assert stored_ids(tmp_path) == ["m-0", "m-1", "m-2"]
    assert [r.seqs for _, r in iter_dispatch_records(dispatch_log)] == [(-1, -1, -1)]


def test_finished_hours_are_deleted_and_a_torn_schedule_tail_is_cut(tmp_path: Path) -> None:
    clock = FakeClock(T0)

    async def script(broker: Broker) -> None:
        await broker.services.producer.produce(
            [delayed(1, T0 + MINUTE), delayed(2, T0 + 2 * HOUR_US)]
        )

    run(tmp_path, clock, script)
    later = segment_path(tmp_path, SegmentKind.SCHEDULE, hour_bucket(T0 + 2 * HOUR_US))
    size = later.stat().st_size
    with open(later, "ab") as handle:
        handle.write(b"\x40\x00\x00\x00garbage")
    problems = recover_schedule(tmp_path).problems
    assert [p for p in problems if "truncated 11 bytes" in p] != []
    assert later.stat().st_size == size
    clock.now_us = T0 + HOUR_US

    async def restart(broker: Broker) -> None:
        await broker.services.delayed.step()
        assert [m["id"] for m in await pull_all(broker)] == ["m-1"]
        numbers = [segment_number(p) for p in list_segments(tmp_path, SegmentKind.SCHEDULE)]
        assert numbers == [hour_bucket(T0 + 2 * HOUR_US)]  # 10:00 is done and gone
        assert list_segments(tmp_path, SegmentKind.DISPATCH) == []
        await advance(broker, clock, T0 + 2 * HOUR_US)
        assert [m["id"] for m in await pull_all(broker)] == ["m-2"]

    run(tmp_path, clock, restart)


def test_a_flipped_bit_in_a_schedule_segment_costs_only_its_record(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    due = T0 + 20 * MINUTE

    async def script(broker: Broker) -> None:
        await broker.services.producer.produce([delayed(i, due) for i in range(20)])

    run(tmp_path, clock, script)
    path = segment_path(tmp_path, SegmentKind.SCHEDULE, hour_bucket(due))
    offsets = [offset for offset, _ in iter_frames(path.read_bytes(), path=str(path))]
    assert len(offsets) == 20
    data = bytearray(path.read_bytes())
    data[offsets[7] + 30] ^= 0x08  # inside the record of m-7
    path.write_bytes(bytes(data))
    recovered = recover_schedule(tmp_path)
    assert sum(counts.pending for counts in recovered.buckets.values()) == 19
    assert [p for p in recovered.problems if "corrupt bytes" in p] != []
    assert path.stat().st_size == len(data)  # nothing truncated

    async def when_due(broker: Broker) -> list[str]:
        await advance(broker, clock, due + SECOND)
        return sorted(m["id"] for m in await pull_all(broker))

    assert run(tmp_path, clock, when_due) == sorted(f"m-{i}" for i in range(20) if i != 7)
