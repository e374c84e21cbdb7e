"""Bucketing, the timing wheel and the scheduled-id set, with times given explicitly."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from qmq_broker.delayed.idset import HashSet64
from qmq_broker.delayed.wheel import TimingWheel, WheelEntry
from qmq_broker.errors import CorruptRecord
from qmq_broker.format import DispatchRecord, MessageRecord
from qmq_broker.format.files import segment_name
from qmq_broker.format.schedule import HOUR_US, ScheduleRecord, hour_bucket, schedule_key

T0 = int(datetime(2030, 1, 1, 10, 0, tzinfo=UTC).timestamp()) * 1_000_000  # an hour start
TICK = 500_000


# --- bucketing ------------------------------------------------------------------------------


def test_hour_buckets_split_exactly_at_the_hour() -> None:
    assert hour_bucket(T0) == hour_bucket(T0 + HOUR_US - 1)
    assert hour_bucket(T0 - 1) == hour_bucket(T0) - 1
    assert hour_bucket(T0 + HOUR_US) == hour_bucket(T0) + 1
    assert hour_bucket(T0) * HOUR_US == T0


def test_buckets_two_years_ahead_are_distinct_hours_with_sortable_names() -> None:
    far = T0 + 730 * 24 * HOUR_US
    assert hour_bucket(far) - hour_bucket(T0) == 730 * 24
    names = [segment_name(hour_bucket(t)) for t in (T0, T0 + HOUR_US, far)]
    assert names == sorted(names)
    assert all(len(n) == len("00000000000000000000.seg") for n in names)


# --- the wheel -------------------------------------------------------------------------------


def test_nothing_pops_before_its_due_time() -> None:
    wheel = TimingWheel(tick_us=TICK)
    wheel.add(T0 + 1_200_000, 16, 10)
    assert wheel.pop_due(T0 + 1_199_999, limit=10) == []
    assert wheel.pop_due(T0 + 1_200_000, limit=10) == [WheelEntry(T0 + 1_200_000, 16, 10)]
    assert len(wheel) == 0


def test_entries_of_one_tick_come_out_in_due_order_then_acceptance_order() -> None:
    wheel = TimingWheel(tick_us=TICK)
    wheel.add(T0 + 400_000, 100, 1)
    wheel.add(T0 + 100_000, 200, 1)
    wheel.add(T0 + 100_000, 150, 1)
    wheel.add(T0 + 300_000, 50, 1)
    assert wheel.pop_due(T0 + 150_000, limit=10) == [
        WheelEntry(T0 + 100_000, 150, 1),
        WheelEntry(T0 + 100_000, 200, 1),
    ]
    assert wheel.next_wakeup_us() == T0 + 300_000  # exact, not the tick end
    assert [e.offset for e in wheel.pop_due(T0 + TICK, limit=10)] == [50, 100]


def test_many_messages_in_one_tick_come_out_in_chunks_in_order() -> None:
    wheel = TimingWheel(tick_us=TICK)
    dues = [T0 + random.randrange(TICK) for _ in range(20_000)]
    for offset, due in enumerate(dues):
        wheel.add(due, offset, 1)
    out: list[WheelEntry] = []
    while chunk := wheel.pop_due(T0 + TICK - 1, limit=1000):
        assert len(chunk) <= 1000
        out.extend(chunk)
    assert len(out) == 20_000
    assert out == sorted(out)
    assert len(wheel) == 0
    assert wheel.next_wakeup_us() is None


def test_hour_boundary_entries_keep_their_order_across_slots() -> None:
    wheel = TimingWheel(tick_us=TICK)
    end = T0 + HOUR_US
    wheel.add(end, 16, 1)  # first instant of the next hour
    wheel.add(end - 1, 9_000, 1)  # last microsecond of this hour
    wheel.add(end + TICK, 32, 1)
    assert wheel.next_wakeup_us() == end - TICK  # the slot holding end - 1 opens first
    assert wheel.pop_due(end - 2, limit=10) == []
    assert [e.deliver_at_us for e in wheel.pop_due(end, limit=10)] == [end - 1, end]
    assert [hour_bucket(d) for d in (end - 1, end)] == [hour_bucket(T0), hour_bucket(T0) + 1]
    assert wheel.pop_due(end + TICK, limit=10)[0].offset == 32


def test_far_future_entries_cost_one_slot_not_a_slot_per_tick() -> None:
    wheel = TimingWheel(tick_us=TICK)
    far = T0 + 365 * 24 * HOUR_US
    wheel.add(far, 16, 1)
    wheel.add(T0 + 10, 32, 1)
    assert len(wheel._slots) == 2
    assert [e.offset for e in wheel.pop_due(T0 + TICK, limit=10)] == [32]
    assert wheel.next_due_us() == far
    assert wheel.pop_due(far - 1, limit=10) == []
    assert wheel.pop_due(far, limit=10)[0].offset == 16


def test_an_entry_added_to_an_opened_tick_is_still_ordered() -> None:
    wheel = TimingWheel(tick_us=TICK)
    wheel.add(T0 + 300_000, 1, 1)
    assert wheel.pop_due(T0 + 100_000, limit=10) == []  # opens the tick
    wheel.add(T0 + 200_000, 2, 1)  # accepted late, due earlier
    wheel.add(T0 + 50_000, 3, 1)  # already due
    assert [e.offset for e in wheel.pop_due(T0 + 100_000, limit=10)] == [3]
    assert [e.offset for e in wheel.pop_due(T0 + 400_000, limit=10)] == [2, 1]


def test_exact_next_due_scans_the_first_slot() -> None:
    wheel = TimingWheel(tick_us=TICK)
    wheel.add(T0 + 480_000, 1, 1)
    wheel.add(T0 + 20_000, 2, 1)
    assert wheel.next_wakeup_us() == T0
    assert wheel.next_due_us() == T0 + 20_000


# --- the scheduled-id set ------------------------------------------------------------------


def test_hash_set_adds_discards_and_stays_compact() -> None:
    ids = HashSet64()
    rng = random.Random(7)
    values = list({rng.getrandbits(64) for _ in range(50_000)})[:50_000]
    assert len(values) == 50_000
    assert all(ids.add(v) for v in values)
    assert not ids.add(values[0])
    assert len(ids) == 50_000
    assert all(v in ids for v in values[:1000])
    assert ids.discard(values[1])
    assert not ids.discard(values[1])
    assert values[1] not in ids
    assert len(ids) == 49_999
    assert ids.nbytes() < 50_000 * 8 * 1.3


def test_hash_set_handles_neighbours_in_one_shard() -> None:
    ids = HashSet64()
    base = 0xABC << 52
    for v in (base + 5, base + 1, base + 3, base, 2**64 - 1, 0):
        ids.add(v)
    assert [v in ids for v in (base, base + 1, base + 2, base + 3, 0, 2**64 - 1)] == [
        True,
        True,
        False,
        True,
        True,
        True,
    ]


# --- records ------------------------------------------------------------------------------


def _message(**overrides: object) -> MessageRecord:
    fields: dict[str, object] = {
        "seq": 0,
        "id": "0193-abc",
        "subject": "order.cancel",
        "key": None,
        "headers": {"traceparent": "00-abc-def-01"},
        "body": b'{"order_id": 42}',
        "body_base64": False,
        "producer": "orders",
        "created_at_us": T0 - 5,
        "stored_at_us": T0,
        "deliver_at_us": T0 + 30 * 60_000_000,
    }
    fields.update(overrides)
    return MessageRecord(**fields)  # type: ignore[arg-type]


def test_schedule_record_keeps_the_whole_message_and_peeks_cheaply() -> None:
    message = _message()
    record = ScheduleRecord(message=message, key=schedule_key(message.subject, message.id))
    payload = record.encode()
    assert ScheduleRecord.decode(payload) == record
    assert ScheduleRecord.peek(payload) == (message.deliver_at_us, record.key)
    assert ScheduleRecord.peek_subject(b"pad" + payload, 3) == "order.cancel"


def test_schedule_keys_differ_by_subject() -> None:
    assert schedule_key("a", "1") != schedule_key("b", "1")
    assert schedule_key("a", "1") == schedule_key("a", "1")
    assert 0 <= schedule_key("a", "1") < 2**64


def test_dispatch_record_round_trips_and_rejects_garbage() -> None:
    record = DispatchRecord(at_us=T0, offsets=(16, 300, 1_000_000), seqs=(4, -1, 5))
    assert DispatchRecord.decode(record.encode()) == record
    with pytest.raises(CorruptRecord) as info:
        DispatchRecord.decode(record.encode()[:-3], path="dispatch/9.seg", offset=16)
    assert info.value.path == "dispatch/9.seg"
    with pytest.raises(CorruptRecord):
        ScheduleRecord.decode(b"\x01" + record.encode())
