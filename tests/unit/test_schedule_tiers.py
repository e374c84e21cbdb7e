"""Coarse schedule buckets (a day, 32 days): where a delayed message goes, how many files a
sparse schedule costs, and the move into finer buckets, including one a crash cut short.

The broker runs in-process on real files with the wall clock in the test's hands (as in
``test_schedule_broker``); ``Tiers`` is checked on its own first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from qmq_broker.delayed.recovery import recover_schedule
from qmq_broker.delayed.tiers import Tiers
from qmq_broker.engine import Broker
from qmq_broker.format import MessageRecord, SegmentKind, list_segments, segment_number
from qmq_broker.format.files import segment_header
from qmq_broker.format.frames import frame
from qmq_broker.format.schedule import (
    COARSE_SCHEDULE_KINDS,
    HOUR_US,
    SCHEDULE_KINDS,
    ScheduleRecord,
    bucket_start_us,
    schedule_bucket,
    schedule_key,
)
from qmq_broker.messages import rfc3339
from qmq_broker.storage.segments import segment_path
from tests.unit.test_schedule_broker import (
    MINUTE,
    SECOND,
    T0,
    FakeClock,
    advance,
    delayed,
    pull_all,
    run,
    stored_ids,
)

DAY = 24 * HOUR_US
LOAD_AHEAD = 5 * MINUTE
TIERS = Tiers(load_ahead_us=LOAD_AHEAD)


def schedule_files(data_dir: Path) -> dict[SegmentKind, list[int]]:
    return {
        kind: [segment_number(p) for p in list_segments(data_dir, kind)] for kind in SCHEDULE_KINDS
    }


def all_files(data_dir: Path) -> list[Path]:
    return [p for p in data_dir.rglob("*") if p.is_file()]


# --- placement ------------------------------------------------------------------------------


def test_a_message_goes_to_the_coarsest_bucket_whose_move_has_not_come() -> None:
    def place(due: int) -> SegmentKind:
        return TIERS.place(due, now_us=T0, moving_through={})[0]

    assert place(T0 + 30 * MINUTE) is SegmentKind.SCHEDULE
    assert place(T0 + 13 * HOUR_US) is SegmentKind.SCHEDULE  # 23:30, today
    assert place(T0 + 20 * HOUR_US) is SegmentKind.SCHEDULE_DAYS  # 06:30 tomorrow
    assert place(T0 + 3 * DAY) is SegmentKind.SCHEDULE_DAYS
    assert place(T0 + 100 * DAY) is SegmentKind.SCHEDULE_32DAYS
    assert place(T0 + 729 * DAY) is SegmentKind.SCHEDULE_32DAYS
    day = schedule_bucket(SegmentKind.SCHEDULE_DAYS, T0 + 3 * DAY)
    assert TIERS.place(T0 + 3 * DAY, now_us=T0, moving_through={}) == (
        SegmentKind.SCHEDULE_DAYS,
        day,
    )


def test_a_bucket_whose_move_began_or_is_due_takes_nothing_more() -> None:
    due = T0 + 3 * DAY
    day = schedule_bucket(SegmentKind.SCHEDULE_DAYS, due)
    moving = {SegmentKind.SCHEDULE_DAYS: day}
    assert TIERS.place(due, now_us=T0, moving_through=moving)[0] is SegmentKind.SCHEDULE
    move_at = TIERS.move_at_us(SegmentKind.SCHEDULE_DAYS, day)
    assert TIERS.place(due, now_us=move_at - 1, moving_through={})[0] is (SegmentKind.SCHEDULE_DAYS)
    assert TIERS.place(due, now_us=move_at, moving_through={})[0] is SegmentKind.SCHEDULE


def test_every_bucket_is_moved_before_any_finer_bucket_of_it_is_needed() -> None:
    """A 32-day bucket moves before its first day does; a day before its first hour loads."""
    for kind in COARSE_SCHEDULE_KINDS:
        bucket = schedule_bucket(kind, T0 + 400 * DAY)
        start = bucket_start_us(kind, bucket)
        finer = SCHEDULE_KINDS[SCHEDULE_KINDS.index(kind) - 1]
        first_finer_needed = (
            start - LOAD_AHEAD  # the hour is loaded into the wheel
            if finer is SegmentKind.SCHEDULE
            else TIERS.move_at_us(finer, schedule_bucket(finer, start))
        )
        assert TIERS.move_at_us(kind, bucket) < first_finer_needed


# --- files of a sparse schedule ---------------------------------------------------------


def test_one_message_an_hour_for_two_years_takes_a_few_dozen_files(tmp_path: Path) -> None:
    """The reported case: 17,400 messages an hour apart made 17,400 hour segments."""
    clock = FakeClock(T0)
    count = 17_400

    async def script(broker: Broker) -> None:
        for first in range(0, count, 1000):
            batch = range(first, min(first + 1000, count))
            await broker.services.producer.produce(
                [delayed(i, T0 + (i + 1) * HOUR_US) for i in batch]
            )
        stats = broker.services.stats.schedule(limit=3)
        assert stats.messages == count
        assert stats.next_due_at == "2030-01-01T11:30:00.000000Z"
        assert [h.hour for h in stats.hours] == [
            "2030-01-01T11:00:00.000000Z",
            "2030-01-01T12:00:00.000000Z",
            "2030-01-01T13:00:00.000000Z",
        ]
        assert stats.more_hours

    run(tmp_path, clock, script)
    files = schedule_files(tmp_path)
    assert len(files[SegmentKind.SCHEDULE]) <= 48  # today's and tomorrow's hours
    assert len(files[SegmentKind.SCHEDULE_DAYS]) <= 32
    assert len(files[SegmentKind.SCHEDULE_32DAYS]) <= 24
    assert len(all_files(tmp_path)) <= 110
    recovered = recover_schedule(tmp_path)
    assert sum(c.pending for c in recovered.buckets.values()) == count
    assert len(recovered.buckets) == count  # counted per due hour wherever they lie


# --- moving ----------------------------------------------------------------------------------


def test_far_messages_are_moved_down_and_delivered_on_time_in_due_order(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    dues = sorted(T0 + HOUR_US + (729 * DAY - HOUR_US) * i // 17 for i in range(18))
    dues += [dues[5] + SECOND, dues[5] + 2 * HOUR_US]  # neighbours in the same day and span
    dues.sort()

    async def script(broker: Broker) -> list[str]:
        await broker.services.producer.produce([delayed(i, due) for i, due in enumerate(dues)])
        got: list[str] = []
        now = T0
        while now < dues[-1]:
            now = min(now + DAY // 4, dues[-1])
            for due in [d for d in dues if clock.now_us < d <= now]:  # each due time exactly
                await advance(broker, clock, due)
                for message in await pull_all(broker):
                    assert message["stored_at"] == rfc3339(due), message["id"]  # not late
                    got.append(message["id"])
            await advance(broker, clock, now)
            got += [m["id"] for m in await pull_all(broker)]
        sample = broker.metrics.registry.get_sample_value
        assert (sample("qmq_broker_schedule_moved_messages_total") or 0) > len(dues)  # 2x some
        assert broker.services.stats.schedule(limit=1).messages == 0
        await advance(broker, clock, dues[-1] + HOUR_US)  # the last hour is over: deleted
        return got

    got = run(tmp_path, clock, script)
    assert got == [f"m-{i}" for i in range(len(dues))]
    assert schedule_files(tmp_path) == {kind: [] for kind in SCHEDULE_KINDS}


def test_a_message_accepted_for_a_day_being_moved_goes_to_its_hour(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    due = T0 + 3 * DAY
    day = schedule_bucket(SegmentKind.SCHEDULE_DAYS, due)
    move_at = TIERS.move_at_us(SegmentKind.SCHEDULE_DAYS, day)

    async def script(broker: Broker) -> list[str]:
        await broker.services.producer.produce([delayed(1, due)])
        assert schedule_files(tmp_path)[SegmentKind.SCHEDULE_DAYS] == [day]
        await advance(broker, clock, move_at)
        assert schedule_files(tmp_path)[SegmentKind.SCHEDULE_DAYS] == []
        await broker.services.producer.produce([delayed(2, due + 1)])
        assert schedule_files(tmp_path)[SegmentKind.SCHEDULE_DAYS] == []
        await advance(broker, clock, due + 1)
        return [m["id"] for m in await pull_all(broker)]

    assert run(tmp_path, clock, script) == ["m-1", "m-2"]


def test_a_move_cut_short_by_a_crash_stores_each_message_once(tmp_path: Path) -> None:
    """The state a crash leaves mid-move: some copies on disk, the coarse source still there."""
    clock = FakeClock(T0)
    day_start = (T0 // DAY + 3) * DAY
    dues = [day_start + i * 20 * MINUTE for i in range(72)]  # 3 an hour for a whole day
    day = schedule_bucket(SegmentKind.SCHEDULE_DAYS, day_start)
    source = segment_path(tmp_path, SegmentKind.SCHEDULE_DAYS, day)
    saved = tmp_path.parent / "day-segment.copy"

    async def schedule(broker: Broker) -> None:
        await broker.services.producer.produce([delayed(i, due) for i, due in enumerate(dues)])

    run(tmp_path, clock, schedule)
    shutil.copyfile(source, saved)
    clock.now_us = TIERS.move_at_us(SegmentKind.SCHEDULE_DAYS, day)

    async def move(broker: Broker) -> None:
        await broker.services.delayed.step()

    run(tmp_path, clock, move)
    assert not source.exists()
    hours = schedule_files(tmp_path)[SegmentKind.SCHEDULE]
    assert len(hours) == 24
    shutil.copyfile(saved, source)  # the source was not deleted yet
    for hour in hours[:10]:  # nor were these copies written
        segment_path(tmp_path, SegmentKind.SCHEDULE, hour).unlink()
    recovered = recover_schedule(tmp_path)
    assert sum(c.pending for c in recovered.buckets.values()) == len(dues)
    [(key, moved)] = recovered.coarse.items()
    assert key == (SegmentKind.SCHEDULE_DAYS, day)
    assert len(moved) == len(dues) - 30  # 14 hours' copies found beside their source

    async def deliver(broker: Broker) -> list[str]:
        assert broker.services.stats.schedule(limit=1).messages == len(dues)
        await broker.services.delayed.step()
        assert not source.exists()
        assert broker.services.stats.schedule(limit=1).messages == len(dues)
        for due in dues:
            await advance(broker, clock, due)
        assert broker.services.stats.schedule(limit=1).messages == 0
        return [m["id"] for m in await pull_all(broker)]

    assert run(tmp_path, clock, deliver) == [f"m-{i}" for i in range(len(dues))]
    assert stored_ids(tmp_path) == [f"m-{i}" for i in range(len(dues))]


def test_a_backlog_in_a_coarse_bucket_goes_out_after_a_restart_in_due_order(
    tmp_path: Path,
) -> None:
    clock = FakeClock(T0)
    dues = [T0 + 50 * DAY + (i * 7919 % 500) * MINUTE for i in range(500)]

    async def schedule(broker: Broker) -> None:
        await broker.services.producer.produce([delayed(i, due) for i, due in enumerate(dues)])

    run(tmp_path, clock, schedule)
    assert schedule_files(tmp_path)[SegmentKind.SCHEDULE_32DAYS] != []
    clock.now_us = max(dues) + HOUR_US  # down until everything came due

    async def restart(broker: Broker) -> list[str]:
        await broker.services.delayed.step()
        return [m["id"] for m in await pull_all(broker)]

    got = run(tmp_path, clock, restart)
    assert got == [f"m-{i}" for i in sorted(range(len(dues)), key=lambda i: dues[i])]
    assert schedule_files(tmp_path) == {kind: [] for kind in SCHEDULE_KINDS}


def test_a_data_dir_with_far_messages_in_hour_segments_still_recovers(tmp_path: Path) -> None:
    """Before coarse buckets every delayed message was in its hour's segment; such a data dir
    (same format 1) is read as it is and its far messages go out when due."""
    far = [T0 + 200 * DAY, T0 + 400 * DAY + 3 * SECOND]
    for i, due in enumerate(far):
        path = segment_path(
            tmp_path, SegmentKind.SCHEDULE, schedule_bucket(SegmentKind.SCHEDULE, due)
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        record = ScheduleRecord(message=_record(i, due), key=schedule_key("orders", f"m-{i}"))
        path.write_bytes(segment_header(SegmentKind.SCHEDULE) + frame(record.encode()))
    clock = FakeClock(T0)

    async def script(broker: Broker) -> list[str]:
        assert broker.services.stats.schedule(limit=5).messages == 2
        (again,) = await broker.services.producer.produce([delayed(1, T0 + DAY)])
        assert again["status"] == "duplicate"
        got: list[str] = []
        for due in far:
            await advance(broker, clock, due - LOAD_AHEAD)
            await advance(broker, clock, due)
            got += [m["id"] for m in await pull_all(broker)]
        return got

    assert run(tmp_path, clock, script) == ["m-0", "m-1"]


def _record(i: int, due: int) -> MessageRecord:
    return MessageRecord(
        seq=0,
        id=f"m-{i}",
        subject="orders",
        key=None,
        headers={},
        body=f"body {i}".encode(),
        body_base64=False,
        producer="old",
        created_at_us=T0,
        stored_at_us=T0,
        deliver_at_us=due,
    )
