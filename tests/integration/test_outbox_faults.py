"""Faults with a real broker process: outages, a killed service, lost responses, competing
compensators, poison messages (PostgreSQL and SQLite)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from qmq_outbox.client import BrokerClient
from qmq_outbox.compensator import Compensator
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import outbox_table
from qmq_outbox.store import OutboxStore
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import (
    clear_outbox,
    pending_rows,
    statuses,
    stored_count,
    stored_ids,
    unique_subject,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def broker(module_broker: BrokerProcess) -> BrokerProcess:
    return module_broker


@pytest.fixture
def late_broker(broker_factory: type[BrokerProcess], tmp_path: Path) -> BrokerProcess:
    """A broker whose port is known but that is not running (yet)."""
    return broker_factory(tmp_path / "late-broker")


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(broker.url) as client:
        yield client


def compensator(engine: sa.Engine, broker: BrokerProcess, **kwargs: Any) -> Compensator:
    options: dict[str, Any] = {"grace": timedelta(0), "batch_size": 500}
    options.update(kwargs)
    return Compensator(engine=engine, broker_url=broker.url, **options)


def test_broker_down_at_commit_then_compensator_delivers(
    engine: sa.Engine, late_broker: BrokerProcess
) -> None:
    subject = unique_subject("down")
    broker = late_broker
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    ids = []
    for _ in range(20):
        with maker.begin() as session:
            ids += [outbox.publish(session, subject, {"i": len(ids)}) for _ in range(5)]
    assert outbox.close(drain_timeout=10)
    assert statuses(engine, subject=subject) == dict.fromkeys(ids, "pending")
    broker.start()
    comp = compensator(engine, broker)
    result = comp.run_once()
    comp.stop(5)
    assert result.sent == 100
    assert statuses(engine, subject=subject) == dict.fromkeys(ids, "sent")
    with BrokerClient(broker.url) as client:
        assert stored_ids(client, subject) == Counter(ids)


async def test_broker_down_at_async_commit(
    pg_url_migrated: str, late_broker: BrokerProcess
) -> None:
    subject = unique_subject("adown")
    broker = late_broker
    check = sa.create_engine(pg_url_migrated)
    clear_outbox(check)
    engine = create_async_engine(pg_url_migrated)
    maker = async_sessionmaker(engine, sync_session_class=sessionmaker())
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    async with maker.begin() as session:
        ids = [outbox.publish(session, subject, {"i": i}) for i in range(10)]
    assert await outbox.aclose()
    await engine.dispose()
    assert statuses(check, subject=subject) == dict.fromkeys(ids, "pending")
    await asyncio.to_thread(broker.start)
    comp = Compensator(engine=check, broker_url=broker.url, grace=timedelta(0))
    comp.run_once()
    comp.stop(5)
    with BrokerClient(broker.url) as client:
        assert stored_ids(client, subject) == Counter(ids)
    check.dispose()


def test_service_killed_right_after_commit(
    db_url: str, engine: sa.Engine, broker: BrokerProcess, client: BrokerClient
) -> None:
    subject = unique_subject("killed")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.outbox_killed_service",
            db_url,
            broker.url,
            subject,
            "7",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    ids = proc.stdout.split()
    assert len(ids) == 7
    assert "survived" not in ids
    assert statuses(engine, subject=subject) == dict.fromkeys(ids, "pending")  # committed
    assert stored_count(client, subject) == 0  # never dispatched
    comp = compensator(engine, broker)
    assert comp.run_once().sent == 7
    comp.stop(5)
    assert stored_ids(client, subject) == Counter(ids)


class LoseResponses(httpx.HTTPTransport):
    """Deliver requests, then drop the first ``n`` responses on the floor."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        response.read()
        if self.left > 0:
            self.left -= 1
            raise httpx.ReadTimeout("response lost", request=request)
        return response


def test_lost_response_then_resend_is_stored_once(
    engine: sa.Engine, broker: BrokerProcess, client: BrokerClient
) -> None:
    subject = unique_subject("lost")
    maker = sessionmaker(engine)
    lossy = BrokerClient(broker.url, transport=LoseResponses(1))
    outbox = Outbox(client=lossy)
    outbox.install(maker)
    with maker.begin() as session:
        ids = [outbox.publish(session, subject, {"i": i}) for i in range(10)]
    assert outbox.close()
    lossy.close()
    assert stored_ids(client, subject) == Counter(ids)  # stored, but the outbox never heard
    assert set(statuses(engine, subject=subject).values()) == {"pending"}
    comp = compensator(engine, broker, backoff_base=timedelta(0), backoff_cap=timedelta(0))
    comp.client = BrokerClient(broker.url, transport=LoseResponses(1))
    first = comp.run_once()  # the compensator's own response is lost too: retry scheduled
    assert (first.sent, first.retried) == (0, 10)
    comp.client = client
    second = comp.run_once()
    comp.stop(5)
    assert (second.sent, second.duplicates) == (10, 10)
    assert comp.metrics.resent._value.get() == 10
    assert stored_count(client, subject) == 10
    assert stored_ids(client, subject) == Counter(ids)


class RecordingStore(OutboxStore):
    """Remembers which rows each ``mark_sent`` call completed, and with which token."""

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(engine)
        self.completed: list[tuple[str, list[int], int]] = []
        self.claimed: dict[str, list[int]] = {}

    def claim(self, **kwargs: Any) -> Any:
        rows = super().claim(**kwargs)
        self.claimed[kwargs["token"]] = [r.id for r in rows]
        return rows

    def mark_sent(self, *, ids: Any, token: str, now: Any) -> int:
        count = super().mark_sent(ids=ids, token=token, now=now)
        self.completed.append((token, list(ids), count))
        return count


def test_two_compensators_on_10000_rows(
    pg_url_migrated: str, broker: BrokerProcess, client: BrokerClient
) -> None:
    engine = sa.create_engine(pg_url_migrated, pool_size=4)
    clear_outbox(engine)
    subject = unique_subject("race")
    OutboxStore(engine).insert(pending_rows(10_000, subject=subject, prefix="race"))
    stores = [RecordingStore(engine), RecordingStore(engine)]
    workers = [
        Compensator(store=s, client=BrokerClient(broker.url), grace=timedelta(0), batch_size=250)
        for s in stores
    ]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(worker: Compensator) -> None:
        try:
            barrier.wait()
            while worker.run_once().claimed:
                pass
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(outbox_table.c.id, outbox_table.c.status, outbox_table.c.claim_token)
        ).all()
    assert len(rows) == 10_000
    assert {r.status for r in rows} == {"sent"}
    token_of = {r.id: r.claim_token for r in rows}
    done_by: list[set[int]] = []
    for store in stores:
        mine = {i for token, ids, count in store.completed for i in ids if token_of[i] == token}
        for token, ids, count in store.completed:
            assert count == sum(1 for i in ids if token_of[i] == token)  # fenced by token
            assert set(ids) <= set(store.claimed[token])
        done_by.append(mine)
    assert not done_by[0] & done_by[1]
    assert len(done_by[0] | done_by[1]) == 10_000
    assert all(done_by), "both compensators should have taken part"
    ids = stored_ids(client, subject)
    assert len(ids) == 10_000
    assert set(ids.values()) == {1}
    for w in workers:
        w.stop(5)
    engine.dispose()


def test_poison_message_goes_dead_while_the_rest_flow(
    engine: sa.Engine, broker: BrokerProcess, client: BrokerClient
) -> None:
    subject = unique_subject("poison")
    store = OutboxStore(engine)
    rows = pending_rows(30, subject=subject, prefix=f"ok{uuid.uuid4().hex[:6]}")
    bad = pending_rows(1, subject="not a subject!", prefix="bad")
    store.insert(rows[:15] + bad + rows[15:])
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    with maker.begin() as session:  # too large for the broker (1 MiB): rejected with 413
        huge = outbox.publish(session, subject, b"x" * (1024 * 1024 + 1))
        fine = outbox.publish(session, subject, {"ok": True})
    assert outbox.close()
    comp = compensator(engine, broker, batch_size=8, max_attempts=3)
    result = comp.run_once()
    comp.stop(5)
    assert (result.sent, result.dead) == (30, 1)
    with engine.connect() as conn:
        dead = conn.execute(
            sa.select(outbox_table.c.message_id, outbox_table.c.last_error, outbox_table.c.attempts)
            .where(outbox_table.c.status == "dead")
            .order_by(outbox_table.c.message_id)
        ).all()
    assert [d.message_id for d in dead] == sorted(["bad-0", huge])
    errors = {d.message_id: d.last_error for d in dead}
    assert "400 invalid_subject" in errors["bad-0"]
    assert "413 body_too_large" in errors[huge]
    assert stored_ids(client, subject) == Counter([r["message_id"] for r in rows] + [fine])


def test_transient_failures_go_dead_after_max_attempts(
    engine: sa.Engine, late_broker: BrokerProcess
) -> None:
    OutboxStore(engine).insert(pending_rows(3, subject=unique_subject("flaky"), prefix="flaky"))
    comp = compensator(
        engine, late_broker, max_attempts=3, backoff_base=timedelta(0), backoff_cap=timedelta(0)
    )
    results = [comp.run_once() for _ in range(4)]
    comp.stop(5)
    assert [(r.retried, r.dead) for r in results] == [(3, 0), (3, 0), (0, 3), (0, 0)]
    with engine.connect() as conn:
        rows = conn.execute(sa.select(outbox_table)).all()
    assert {(r.status, r.attempts) for r in rows} == {("dead", 3)}
    assert all("broker unreachable" in r.last_error for r in rows)


def test_compensator_background_service(
    engine: sa.Engine, broker: BrokerProcess, client: BrokerClient
) -> None:
    subject = unique_subject("bg")
    comp = compensator(engine, broker, interval=timedelta(milliseconds=50))
    comp.start()
    try:
        OutboxStore(engine).insert(pending_rows(50, subject=subject, prefix="bg"))
        wait_for(lambda: stored_count(client, subject) == 50, what="50 stored")
        wait_for(lambda: set(statuses(engine, subject=subject).values()) == {"sent"})
    finally:
        assert comp.stop(10)


def test_delayed_message_is_scheduled_and_its_row_sent(
    engine: sa.Engine, broker: BrokerProcess, client: BrokerClient
) -> None:
    subject = unique_subject("later")
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    with maker.begin() as session:
        message_id = outbox.publish(session, subject, {"x": 1}, delay=timedelta(hours=1))
    assert outbox.close()
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(outbox_table).where(outbox_table.c.message_id == message_id)
        ).one()
    assert row.status == "sent"
    assert row.deliver_at is not None
    assert stored_count(client, subject) == 0  # scheduled, not yet on the subject
