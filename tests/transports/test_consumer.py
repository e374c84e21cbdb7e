"""The consumer on every transport: exactly-once effects with retries after the handler's
delay, dead letters after the last attempt; and what JetStream and RabbitMQ refuse."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message, Outbox, OutgoingMessage, RetryLater
from qmq_outbox.errors import UnsupportedByTransport
from qmq_outbox.transports.base import Transport
from tests.integration.consumer_support import count, invoices, running, wait_for
from tests.transports.kits import Kit

pytestmark = pytest.mark.timeout(60)


def produce(transport: Transport, subject: str, orders: list[str]) -> list[str]:
    messages = [
        OutgoingMessage(
            id=f"{subject}-{order}", subject=subject, body=f'{{"order_id": "{order}"}}'.encode()
        )
        for order in orders
    ]
    producer = transport.producer()
    try:
        outcomes = producer.produce(messages)
    finally:
        producer.close()
    assert [getattr(outcome, "status", outcome) for outcome in outcomes] == ["stored"] * len(orders)
    return [m.id for m in messages]


def test_exactly_once_with_a_retry_after_the_handlers_delay(kit: Kit, engine: Engine) -> None:
    subject, group = kit.subject(), kit.group()
    kit.prepare(subject, group)
    orders = [f"o-{i}" for i in range(6)]
    produce(kit.transport(), subject, orders)
    seen: dict[str, list[tuple[int, float]]] = {}
    lock = threading.Lock()

    def bill(message: Message, session: Session) -> None:
        order = message.json()["order_id"]
        with lock:
            seen.setdefault(order, []).append((message.attempt, time.monotonic()))
        if order == "o-1" and message.attempt == 1:
            raise RetryLater(0.5, "ledger busy")
        session.execute(sa.insert(invoices).values(order_id=order, message_id=message.id, amount=1))

    consumer = Consumer(transport=kit.transport(), group=group, wait_ms=200, ack_interval=0.02)
    consumer.add_handler(subject, bill, idempotent=IdempotentStore(sessionmaker(engine)))
    with running(consumer):
        wait_for(lambda: count(engine, invoices) == len(orders), what="every order billed")
    assert [attempt for attempt, _ in seen["o-1"]] == [1, 2]
    (_, first), (_, second) = seen["o-1"]
    assert second - first >= 0.45, "the retry came before the handler's delay"
    assert all(len(times) == 1 for order, times in seen.items() if order != "o-1")
    assert consumer.stats().processed == len(orders)
    assert consumer.stats().nacked == 1


def test_dead_letter_after_the_last_attempt(kit: Kit, engine: Engine) -> None:
    """Every kit allows 3 attempts; the third failure dead-letters with the error."""
    subject, group = kit.subject(), kit.group()
    kit.prepare(subject, group)
    (poison, fine) = produce(kit.transport(), subject, ["poison", "fine"])
    attempts: list[int] = []

    def handle(message: Message) -> None:
        if message.json()["order_id"] == "poison":
            attempts.append(message.attempt)
            raise RetryLater(0.05, f"cannot bill (attempt {message.attempt})")

    consumer = Consumer(transport=kit.transport(), group=group, wait_ms=200, ack_interval=0.02)
    consumer.add_handler(subject, handle)
    with running(consumer):
        dead = wait_for(lambda: kit.dead_letters(subject, group), what="the dead letter")
    assert attempts == [1, 2, 3]
    assert [(d.id, d.attempts) for d in dead] == [(poison, 3)]
    assert "attempt 3" in (dead[0].error or "")
    assert consumer.stats().processed == 1  # the fine one
    assert fine != poison


@pytest.fixture(params=["jetstream", "rabbitmq"])
def other(request: pytest.FixtureRequest) -> Kit:
    found: Kit = request.getfixturevalue(f"{request.param}_kit")
    return found


def test_broadcast_and_ordered_are_the_qmq_brokers_alone(other: Kit) -> None:
    with pytest.raises(UnsupportedByTransport, match="broadcast"):
        Consumer(transport=other.transport(), group="g", mode="broadcast")
    consumer = Consumer(other.url(), "g")  # the URL form picks the same transport
    assert type(consumer.transport) is type(other.transport())
    with pytest.raises(UnsupportedByTransport, match="ordered"):
        consumer.add_handler("a.b", lambda m: None, ordered=True)
    for start in ({"seq": 3}, {"time": "2026-11-28T09:00:00Z"}):
        with pytest.raises(UnsupportedByTransport, match="earliest or latest only"):
            Consumer(transport=other.transport(), group="g", start=start)


@pytest.fixture
def sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine)


def test_a_delay_is_refused_at_publish(other: Kit, sessions: sessionmaker[Session]) -> None:
    outbox = Outbox(transport=other.transport(), dispatch=False)
    outbox.install(sessions)
    with sessions() as session, pytest.raises(UnsupportedByTransport, match="delay"):
        outbox.publish(session, "a.b", {}, delay=timedelta(seconds=5))
    # a delayed row sent by a compensator is rejected, not silently sent at once
    late = OutgoingMessage(
        id="late", subject=other.subject(), body=b"{}", deliver_at=datetime.now(UTC)
    )
    producer = other.transport().producer()
    try:
        (outcome,) = producer.produce([late])
    finally:
        producer.close()
    assert getattr(outcome, "code", None) == "delay_not_supported"


def test_a_handler_with_tags_runs_only_on_those_tags(kit: Kit) -> None:
    """On every transport the handler sees only its tags, with the tags read back; the qmq
    broker skips the others (no pull), JetStream and RabbitMQ deliver them and the consumer
    acks them unrun (``stats().filtered``)."""
    subject, group = kit.subject(), kit.group()
    kit.prepare(subject, group)
    messages = [
        OutgoingMessage(
            id=f"{subject}-{i}",
            subject=subject,
            body=f'{{"i": {i}}}'.encode(),
            tags=("vip",) if i % 3 == 0 else ("plain", "bulk"),
        )
        for i in range(9)
    ]
    producer = kit.transport().producer()
    try:
        producer.produce(messages)
    finally:
        producer.close()
    seen: list[tuple[int, tuple[str, ...]]] = []
    lock = threading.Lock()

    def handle(message: Message) -> None:
        with lock:
            seen.append((message.json()["i"], message.tags))

    consumer = Consumer(transport=kit.transport(), group=group, wait_ms=200, ack_interval=0.02)
    consumer.add_handler(subject, handle, tags=["vip"])
    with running(consumer):
        wait_for(lambda: len(seen) == 3, what="the vip messages handled")
        if kit.name != "qmq":
            wait_for(lambda: consumer.stats().filtered == 6, what="the rest acked unrun")
    assert sorted(seen) == [(0, ("vip",)), (3, ("vip",)), (6, ("vip",))]
    stats = consumer.stats()
    assert (stats.processed, stats.filtered) == (3, 0 if kit.name == "qmq" else 6)
