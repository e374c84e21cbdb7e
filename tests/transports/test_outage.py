"""A transport that cannot be reached (its path cut by a proxy, or JetStream's stream
deleted): committed messages stay pending, and the compensator sends them once it is back,
each stored once."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from qmq_outbox import Outbox, OutgoingMessage
from qmq_outbox.compensator import Compensator
from qmq_outbox.errors import BrokerUnavailable
from tests.integration.consumer_support import wait_for
from tests.support.outbox import statuses
from tests.transports.kits import JetStreamKit, Kit
from tests.transports.proxy import Proxy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def proxy(kit: Kit) -> Iterator[Proxy]:
    proxy = Proxy(kit.port)
    yield proxy
    proxy.close()


def test_outage_leaves_rows_pending_and_the_compensator_sends_them_once(
    kit: Kit, proxy: Proxy, engine: Engine
) -> None:
    subject = kit.subject()
    kit.prepare(subject)
    maker = sessionmaker(engine)
    outbox = Outbox(transport=kit.transport(proxy.port), app="outage")
    outbox.install(maker)
    orders = itertools.count()

    def publish() -> str:
        with maker.begin() as session:
            return outbox.publish(session, subject, {"order_id": f"o-{next(orders)}"})

    try:
        before = publish()
        wait_sent(engine, subject, [before])  # the producer is connected through the proxy
        proxy.cut()
        during = [publish(), publish()]
        assert outbox.close(15)  # drained: the sends failed, the rows stay pending
    finally:
        outbox.close()
    assert statuses(engine, subject=subject) == {before: "sent"} | dict.fromkeys(during, "pending")

    proxy.restore()
    compensator = Compensator(
        engine=engine, transport=kit.transport(proxy.port), grace=timedelta(0)
    )
    try:
        result = compensator.run_once()
    finally:
        compensator.stop(5)
    assert result.sent == 2
    assert statuses(engine, subject=subject) == dict.fromkeys([before, *during], "sent")
    assert kit.stored(subject) == Counter([before, *during])


def wait_sent(engine: Engine, subject: str, ids: list[str]) -> None:
    wait_for(lambda: statuses(engine, subject=subject) == dict.fromkeys(ids, "sent"))


def test_a_deleted_stream_is_transient_and_made_again(jetstream_kit: Kit) -> None:
    assert isinstance(jetstream_kit, JetStreamKit)
    subject = jetstream_kit.subject("gone")  # a stream of its own
    producer = jetstream_kit.transport().producer()
    try:
        first = OutgoingMessage(id=f"{subject}-1", subject=subject, body=b"{}")
        second = OutgoingMessage(id=f"{subject}-2", subject=subject, body=b"{}")
        assert [o.status for o in producer.produce([first])] == ["stored"]  # type: ignore[union-attr]
        jetstream_kit.delete_stream_of(subject)
        (outcome,) = producer.produce([second])
        assert isinstance(outcome, BrokerUnavailable)
        assert "no stream answered" in str(outcome)
        (outcome,) = producer.produce([second])  # the next attempt makes the stream again
        assert getattr(outcome, "status", outcome) == "stored"
    finally:
        producer.close()
    assert jetstream_kit.stored(subject) == Counter([second.id])
