"""The compensator's pass logic on SQLite with the in-memory fake broker."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest

from qmq_outbox.compensator import Compensator
from qmq_outbox.compensator.config import CompensatorConfig, CompensatorSettings
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.schema import metadata, outbox_table
from qmq_outbox.store import OutboxStore
from qmq_outbox.testing import InMemoryBroker
from tests.support.outbox import pending_rows, sqlite_transactions, statuses, wait_for

NO_BACKOFF = {"backoff_base": timedelta(0), "backoff_cap": timedelta(0)}


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sqlite_transactions(sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def store(engine: sa.Engine) -> OutboxStore:
    return OutboxStore(engine)


@pytest.fixture
def fake() -> InMemoryBroker:
    return InMemoryBroker()


def compensator(store: OutboxStore, fake: InMemoryBroker, **kwargs: object) -> Compensator:
    options: dict[str, object] = {"grace": timedelta(seconds=30), "batch_size": 4}
    options.update(kwargs)
    return Compensator(store=store, client=fake.client(), rng=random.Random(1), **options)  # type: ignore[arg-type]


def row(engine: sa.Engine, message_id: str) -> sa.Row[object]:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(outbox_table).where(outbox_table.c.message_id == message_id)
        ).one()


def test_grace_leaves_young_rows_to_the_dispatcher(
    store: OutboxStore, engine: sa.Engine, fake: InMemoryBroker
) -> None:
    store.insert(pending_rows(3, subject="s", age=60, prefix="old"))
    store.insert(pending_rows(2, subject="s", age=1, prefix="young"))
    result = compensator(store, fake).run_once()
    assert (result.claimed, result.sent) == (3, 3)
    assert sorted(fake.ids) == ["old-0", "old-1", "old-2"]
    assert statuses(engine)["young-0"] == "pending"


def test_retries_with_backoff_then_dead_after_max_attempts(
    store: OutboxStore, engine: sa.Engine, fake: InMemoryBroker
) -> None:
    store.insert(pending_rows(2, subject="s", prefix="r"))
    fake.available = False
    comp = compensator(
        store, fake, max_attempts=3, backoff_base=timedelta(hours=1), backoff_cap=timedelta(hours=2)
    )
    first = comp.run_once()
    assert (first.claimed, first.retried, first.dead) == (2, 2, 0)
    retry_at = row(engine, "r-0").next_attempt_at.replace(tzinfo=UTC)
    delay = retry_at - datetime.now(UTC)
    assert timedelta(minutes=29) < delay <= timedelta(hours=1)  # equal jitter: [base/2, base]
    assert comp.run_once().claimed == 0  # not due yet
    with engine.begin() as conn:  # an hour passes
        past = datetime.now(UTC) - timedelta(seconds=1)
        conn.execute(sa.update(outbox_table).values(next_attempt_at=past))
    comp = compensator(store, fake, max_attempts=3, **NO_BACKOFF)
    assert comp.run_once().retried == 2
    third = comp.run_once()
    assert (third.claimed, third.dead) == (2, 2)
    dead = row(engine, "r-0")
    assert (dead.status, dead.attempts) == ("dead", 3)
    assert "503" in dead.last_error
    assert comp.run_once().claimed == 0


def test_permanent_rejection_is_dead_at_once_while_the_rest_flow(
    store: OutboxStore, engine: sa.Engine, fake: InMemoryBroker
) -> None:
    store.insert(pending_rows(9, subject="s", prefix="ok"))
    store.insert(pending_rows(1, subject="not a subject", prefix="poison"))
    comp = compensator(store, fake)
    result = comp.run_once()
    assert (result.sent, result.dead) == (9, 1)
    poison = row(engine, "poison-0")
    assert (poison.status, poison.attempts) == ("dead", 1)
    assert "invalid_subject" in poison.last_error
    assert comp.metrics.dead._value.get() == 1


def test_completion_is_fenced_by_the_claim_token(store: OutboxStore, engine: sa.Engine) -> None:
    store.insert(pending_rows(3, subject="s", prefix="f"))
    now = datetime.now(UTC)
    a = store.claim(token="A", now=now, grace=timedelta(0), lease=timedelta(0), limit=10)
    later = now + timedelta(milliseconds=1)
    b = store.claim(token="B", now=later, grace=timedelta(0), lease=timedelta(60), limit=10)
    assert [r.id for r in a] == [r.id for r in b]  # A's lease ran out: B took over
    assert [r.attempts for r in b] == [2, 2, 2]
    assert store.claim(token="C", now=later, grace=timedelta(0), lease=timedelta(0), limit=10) == []
    assert store.mark_sent(ids=[r.id for r in a], token="A", now=later) == 0
    assert store.mark_dead(ids=[r.id for r in a], token="A", error="x") == 0
    assert store.mark_sent(ids=[r.id for r in b], token="B", now=later) == 3
    with engine.connect() as conn:
        tokens = conn.execute(sa.select(outbox_table.c.claim_token, outbox_table.c.status))
        assert {tuple(t) for t in tokens} == {("B", "sent")}


def test_lost_response_then_resend_is_stored_once(
    store: OutboxStore, engine: sa.Engine, fake: InMemoryBroker
) -> None:
    store.insert(pending_rows(4, subject="s", prefix="l"))
    fake.lose_responses = 1
    comp = compensator(store, fake, **NO_BACKOFF)
    assert comp.run_once().retried == 4
    result = comp.run_once()
    assert (result.sent, result.duplicates) == (4, 4)
    assert sum(fake.ids.values()) == 4
    assert comp.metrics.resent._value.get() == 4


def test_purge_keeps_recent_and_pending_rows(store: OutboxStore, engine: sa.Engine) -> None:
    old = datetime.now(UTC) - timedelta(days=8)
    rows = pending_rows(7, subject="s", prefix="old")
    for r in rows:
        r.update(status="sent", sent_at=old)
    recent = pending_rows(2, subject="s", prefix="new")
    for r in recent:
        r.update(status="sent", sent_at=datetime.now(UTC))
    store.insert(rows + recent + pending_rows(1, subject="s", prefix="pend"))
    comp = Compensator(store=store, client=InMemoryBroker().client(), purge_batch_size=3)
    assert comp.purge() == 7
    assert sorted(statuses(engine)) == ["new-0", "new-1", "pend-0"]


def test_metrics(store: OutboxStore, fake: InMemoryBroker) -> None:
    store.insert(pending_rows(5, subject="s", prefix="m"))
    store.insert(pending_rows(2, subject="s", age=0, prefix="young"))
    comp = compensator(store, fake)
    comp.run_once()
    text = generate_latest(comp.registry).decode()
    assert "qmq_compensator_pending_messages 2.0" in text
    assert "qmq_compensator_sent_messages_total 5.0" in text
    for name in (
        "qmq_compensator_oldest_pending_age_seconds",
        "qmq_compensator_resent_messages_total",
        "qmq_compensator_dead_messages_total",
        "qmq_compensator_claim_duration_seconds_bucket",
        "qmq_compensator_send_duration_seconds_count",
    ):
        assert name in text
    age = comp.metrics.oldest_pending_age._value.get()
    assert 0 <= age < 30


def test_background_start_and_stop(
    store: OutboxStore, engine: sa.Engine, fake: InMemoryBroker
) -> None:
    comp = compensator(store, fake, interval=timedelta(milliseconds=20), name="qmq-comp-test")
    comp.start()
    try:
        store.insert(pending_rows(6, subject="s", prefix="bg"))
        wait_for(lambda: set(statuses(engine).values()) == {"sent"}, what="rows sent")
        names = {t.name for t in threading.enumerate()}
        assert "qmq-comp-test-scheduler" in names
        assert any(n.startswith("qmq-comp-test") and n != "qmq-comp-test-scheduler" for n in names)
    finally:
        assert comp.stop(timeout=10)
    assert sum(fake.ids.values()) == 6


def test_keywords_and_config_build_one_config(store: OutboxStore, fake: InMemoryBroker) -> None:
    base = CompensatorConfig(batch_size=7, lease=timedelta(seconds=5))
    comp = Compensator(store=store, client=fake.client(), config=base, batch_size=9)
    assert comp.config == CompensatorConfig(batch_size=9, lease=timedelta(seconds=5))
    assert Compensator(store=store, client=fake.client()).config == CompensatorConfig()


def test_the_keyword_arguments_are_the_config_fields() -> None:
    fields = [field.name for field in dataclasses.fields(CompensatorConfig)]
    assert list(CompensatorSettings.__annotations__) == fields


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"max_attempts": 0}])
def test_a_config_below_one_is_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigurationError, match="at least 1"):
        CompensatorConfig(**bad)
