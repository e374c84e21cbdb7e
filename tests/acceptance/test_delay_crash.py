"""kill -9 with delayed messages pending: after a restart each one is stored exactly once,
including those that came due while the broker was down and those cut off mid-dispatch."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import Message, OutgoingMessage
from tests.support.broker_process import BrokerProcess
from tests.support.metrics import metric


def delayed(i: int, deliver_at: datetime) -> OutgoingMessage:
    return OutgoingMessage(
        id=f"d-{i}", subject="orders", body=f"b{i}".encode(), deliver_at=deliver_at
    )


def drain(client: BrokerClient, group: str, expect: int, timeout: float) -> list[Message]:
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < expect and time.monotonic() < deadline:
        got = client.pull("orders", group, "c", max_messages=1000, wait_ms=500)
        if got:
            client.ack("orders", group, "c", [m.seq for m in got])
        out.extend(got)
    return out


def assert_once_each(messages: list[Message], count: int) -> None:
    ids = [m.id for m in messages]
    assert sorted(ids) == sorted(f"d-{i}" for i in range(count)), "missing or repeated ids"
    assert sorted(m.seq for m in messages) == list(range(count))


def test_restart_delivers_each_pending_message_exactly_once(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    proc = broker_factory(tmp_path / "d").start()
    start = datetime.now(UTC)
    count = 300
    # due between 1 s and 7 s from now; the broker is down from ~2.5 s to ~5 s
    dues = [start + timedelta(seconds=1 + 6 * i / count) for i in range(count)]
    tomorrow = start + timedelta(days=1)
    with BrokerClient(proc.url) as client:
        for first in range(0, count, 100):
            batch = [delayed(i, dues[i]) for i in range(first, first + 100)]
            assert {r.status for r in client.produce(batch)} == {"scheduled"}
        client.produce([delayed(count, tomorrow)])
        early = drain(client, "live", expect=10**9, timeout=1.5)  # until ~2.5 s
    assert early, "some messages went out before the crash"
    proc.kill9()
    time.sleep(max(0.0, (start + timedelta(seconds=5) - datetime.now(UTC)).total_seconds()))
    proc.restart()
    with BrokerClient(proc.url) as client:
        everything = drain(client, "audit", expect=count, timeout=15)
        assert_once_each(everything, count)
        stored = {m.id: m for m in everything}
        for i, due in enumerate(dues):
            stored_at = stored[f"d-{i}"].stored_at
            assert stored_at is not None
            assert stored_at >= due
        assert client.subject("orders")["messages"] == count
        assert client.subject("orders")["scheduled"]["messages"] == 1  # tomorrow's
        assert client.produce([delayed(count, tomorrow)])[0].status == "duplicate"
        assert client.produce([delayed(5, tomorrow)])[0].status == "duplicate"


def test_kill_mid_dispatch_of_a_burst_stores_each_message_once(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    proc = broker_factory(tmp_path / "d").start()
    count = 4000
    total = 0
    with BrokerClient(proc.url) as client:
        for round_no, kill_after in enumerate((0.02, 0.08, 0.25)):
            due = datetime.now(UTC) + timedelta(seconds=1.5)
            batch = [delayed(total + i, due) for i in range(count)]
            for first in range(0, count, 1000):
                client.produce(batch[first : first + 1000])
            total += count
            time.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()) + kill_after)
            proc.kill9()
            proc.restart()
            stats = drain_until_dispatched(client, total)
            assert stats == total, f"round {round_no}: {stats} stored of {total}"
        everything = drain(client, "audit", expect=total, timeout=30)
    assert_once_each(everything, total)


def drain_until_dispatched(client: BrokerClient, total: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    stored = 0
    while time.monotonic() < deadline:
        stored = int(client.subject("orders")["messages"])
        if stored >= total and client.subject("orders")["scheduled"]["messages"] == 0:
            break
        time.sleep(0.1)
    return stored


def test_a_dispatch_on_an_idle_broker_is_durable_before_the_next_write(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    """The dispatch record goes to disk with its own fsync: a kill -9 a moment after an idle
    broker's dispatch, with nothing written since, leaves nothing to send again."""
    proc = broker_factory(tmp_path / "d").start()
    due = datetime.now(UTC) + timedelta(seconds=0.5)
    with BrokerClient(proc.url) as client:
        client.produce([delayed(i, due) for i in range(5)])
        assert drain_until_dispatched(client, 5) == 5
        time.sleep(0.2)  # well under the checkpoint's interval: only the record's own write
    proc.kill9()
    proc.restart()
    with BrokerClient(proc.url) as client:
        assert metric(proc.url, "qmq_broker_schedule_redispatched_messages_total") == 0
        assert_once_each(drain(client, "audit", expect=5, timeout=5), 5)
