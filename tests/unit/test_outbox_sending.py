"""Batching, poison isolation, backoff, and the dispatcher's backlog, with the fake broker."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox.backoff import backoff_delay
from qmq_outbox.dispatcher import Backlog, ThreadDispatcher
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import metadata
from qmq_outbox.sending import chunks, send
from qmq_outbox.testing import InMemoryBroker
from tests.support.outbox import sqlite_transactions, statuses, wait_for


def msg(i: int, subject: str = "s", size: int = 3) -> OutgoingMessage:
    return OutgoingMessage(id=f"m{i}", subject=subject, body=b"x" * size)


def test_chunks_by_count_and_bytes() -> None:
    messages = [msg(i, size=10) for i in range(7)]
    assert [len(c) for c in chunks(messages, max_count=3, max_bytes=1000)] == [3, 3, 1]
    assert [len(c) for c in chunks(messages, max_count=100, max_bytes=25)] == [2, 2, 2, 1]
    big = [msg(0, size=100), msg(1, size=1)]
    assert [len(c) for c in chunks(big, max_count=100, max_bytes=10)] == [1, 1]


def test_poison_messages_are_isolated() -> None:
    fake = InMemoryBroker(max_body=50)
    messages = [msg(i) for i in range(20)]
    messages[3] = msg(3, subject="bad subject")
    messages[15] = msg(15, size=100)
    report = send(fake.client(), messages, max_count=8)
    assert sorted(m.id for m, _ in report.rejected) == ["m15", "m3"]
    assert {e.code for _, e in report.rejected} == {"invalid_subject", "body_too_large"}
    assert sorted(r.id for r in report.results) == sorted(
        f"m{i}" for i in range(20) if i not in (3, 15)
    )
    assert sum(fake.ids.values()) == 18
    assert report.error is None
    assert report.unsent == []


def test_unavailable_stops_the_send() -> None:
    fake = InMemoryBroker()
    fake.available = False
    report = send(fake.client(), [msg(i) for i in range(5)], max_count=2)
    assert report.error is not None
    assert [m.id for m in report.unsent] == [f"m{i}" for i in range(5)]
    assert fake.requests == 1


def test_backoff_grows_caps_and_jitters() -> None:
    rng = random.Random(7)
    base, cap = timedelta(seconds=1), timedelta(seconds=60)
    delays = [backoff_delay(n, base=base, cap=cap, rng=rng).total_seconds() for n in range(1, 12)]
    for n, delay in enumerate(delays, start=1):
        ceiling = min(60.0, 2.0 ** (n - 1))
        assert ceiling / 2 <= delay <= ceiling
    assert len({round(d, 6) for d in delays}) == len(delays)
    assert backoff_delay(10_000, base=base, cap=cap).total_seconds() <= 60


def test_backlog_is_bounded_all_or_nothing() -> None:
    backlog = Backlog(capacity=5)
    engine = sa.create_engine("sqlite://")
    assert backlog.offer(engine, [msg(i) for i in range(3)])
    assert not backlog.offer(engine, [msg(i) for i in range(3)])
    assert backlog.offer(engine, [msg(3), msg(4)])
    assert [m.id for _, m in backlog.take(4)] == ["m0", "m1", "m2", "m3"]
    assert len(backlog) == 1


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sqlite_transactions(sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def test_full_queue_and_outage_leave_rows_pending(engine: sa.Engine) -> None:
    fake = InMemoryBroker()
    fake.available = False
    maker = sessionmaker(engine)
    outbox = Outbox(client=fake.client(), queue_size=2)
    outbox.install(maker)
    with maker.begin() as session:  # too big for the queue: never queued
        ids = [outbox.publish(session, "s", {"i": i}) for i in range(3)]
    with maker.begin() as session:  # queued, broker down: stays pending
        ids.append(outbox.publish(session, "s", {"i": 3}))
    assert outbox.close(drain_timeout=5)
    assert set(statuses(engine).values()) == {"pending"}
    assert len(statuses(engine)) == 4
    assert fake.requests == 1


def test_breaker_skips_sends_after_an_outage(engine: sa.Engine) -> None:
    fake = InMemoryBroker()
    fake.available = False
    dispatcher = ThreadDispatcher(fake.client(), cooldown=60, senders=1)
    now = datetime.now(UTC)
    first = OutgoingMessage(id="a", subject="s", body=b"{}", created_at=now)
    assert dispatcher.submit(engine, [first])
    wait_for(lambda: fake.requests == 1, what="first attempt")
    wait_for(lambda: not dispatcher.submit(engine, [first]), what="breaker open")
    assert dispatcher.close(1)
    assert fake.requests == 1


def test_close_drains_the_queue(engine: sa.Engine) -> None:
    fake = InMemoryBroker()
    maker: sessionmaker[Session] = sessionmaker(engine)
    outbox = Outbox(client=fake.client(), batch_size=7)
    outbox.install(maker)
    ids = []
    for i in range(30):
        with maker.begin() as session:
            ids.append(outbox.publish(session, "s", {"i": i}))
    assert outbox.close(drain_timeout=10)
    assert set(fake.ids) == set(ids)
    assert set(statuses(engine).values()) == {"sent"}


def test_rejected_by_the_dispatcher_goes_dead(engine: sa.Engine) -> None:
    fake = InMemoryBroker(max_body=20)
    maker: sessionmaker[Session] = sessionmaker(engine)
    outbox = Outbox(client=fake.client())
    outbox.install(maker)
    with maker.begin() as session:
        good = outbox.publish(session, "s", {"i": 1})
        bad = outbox.publish(session, "s", "x" * 100)
    assert outbox.close()
    assert statuses(engine) == {good: "sent", bad: "dead"}
