"""The seam's pure parts, without a service: URLs, names, per-message outcomes, key order."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from qmq_outbox.envelope import OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable, ConfigurationError
from qmq_outbox.sending import SendPlan
from qmq_outbox.transports import QmqTransport, from_url
from qmq_outbox.transports.base import Outcome, retry_delay
from qmq_outbox.transports.jetstream import JetStreamTransport
from qmq_outbox.transports.jetstream.streams import covers
from qmq_outbox.transports.keyorder import publish_in_key_order
from qmq_outbox.transports.rabbitmq import RabbitMqTransport


def msg(i: int, key: str | None = None) -> OutgoingMessage:
    return OutgoingMessage(id=f"m{i}", subject="order.created", body=b"{}", key=key)


def stored(message: OutgoingMessage) -> ProduceResult:
    return ProduceResult(id=message.id, subject=message.subject, status="stored", seq=None)


def test_the_url_scheme_picks_the_transport_and_its_query_the_settings() -> None:
    assert from_url("http://127.0.0.1:8931", token="t") == QmqTransport(
        url="http://127.0.0.1:8931", token="t"
    )
    nats = from_url("nats://127.0.0.1:4222?stream_prefix=ORD&lease=500ms&max_attempts=4")
    assert nats == JetStreamTransport(
        url="nats://127.0.0.1:4222",
        stream_prefix="ORD",
        lease=timedelta(milliseconds=500),
        max_attempts=4,
    )
    rabbit = from_url("amqp://u:p@127.0.0.1:5672/?exchange=ex&mandatory=false&heartbeat=30")
    assert rabbit == RabbitMqTransport(
        url="amqp://u:p@127.0.0.1:5672/?heartbeat=30", exchange="ex", mandatory=False
    )  # aio-pika's own options stay in its URL
    with pytest.raises(ConfigurationError, match="unknown option 'leese'"):
        from_url("nats://127.0.0.1:4222?leese=1s")
    with pytest.raises(ConfigurationError, match="max_attempts"):
        from_url("nats://127.0.0.1:4222?max_attempts=many")
    with pytest.raises(ConfigurationError, match="not a broker URL"):
        from_url("redis://127.0.0.1:6379")
    assert not rabbit.capabilities.dedup
    assert nats.capabilities.dedup
    assert not nats.capabilities.delay
    assert QmqTransport(url="http://x").capabilities.delay


def test_names_of_streams_durables_and_queues() -> None:
    nats = JetStreamTransport(stream_prefix="QMQ")
    assert nats.stream_for("order.created") == "QMQ_ORDER"
    assert nats.stream_for("order") == "QMQ_ORDER"
    assert nats.dead_stream == "QMQ-DEAD"
    assert nats.dead_subject("order.created") == "qmq-dead.order.created"
    a, b = (
        nats.durable_name("billing", "order.created"),
        nats.durable_name("billing", "order_created"),
    )
    assert a != b
    assert "." not in a
    assert a.startswith("qmq_billing__order_created_")
    custom = JetStreamTransport(stream_name=lambda subject: "ALL")
    assert custom.stream_for("x.y") == "ALL"
    rabbit = RabbitMqTransport()
    assert rabbit.queue_name("billing", "order.created") == "billing.order.created"
    long = rabbit.queue_name("g" * 200, "s" * 200)
    assert len(long.encode()) <= 249
    assert long != rabbit.queue_name("g" * 200, "s" * 199 + "t")


@pytest.mark.parametrize(
    ("pattern", "subject", "covered"),
    [
        ("order.>", "order.created", True),
        ("order.>", "order", False),
        ("order", "order", True),
        ("order.*", "order.created", True),
        ("order.*", "order.created.eu", False),
        ("order.*", "order.>", False),
        (">", "order.>", True),
        ("order.>", "order.>", True),
        ("orders.>", "order.created", False),
    ],
)
def test_stream_subjects_cover(pattern: str, subject: str, covered: bool) -> None:
    assert covers(pattern, subject) is covered


def test_per_message_outcomes_stop_the_send_at_a_transient_one() -> None:
    messages = [msg(i) for i in range(6)]
    plan = SendPlan(messages, max_count=3)
    first = plan.next_batch()
    assert first is not None
    rejected = BrokerRejected(status=None, code="body_too_large", message="JetStream: big")
    plan.answered(first, [stored(first[0]), rejected, stored(first[2])])
    second = plan.next_batch()
    assert second is not None
    plan.answered(second, [stored(second[0]), BrokerUnavailable("no PubAck"), stored(second[2])])
    assert plan.next_batch() is None
    report = plan.report
    assert [r.id for r in report.results] == ["m0", "m2", "m3", "m5"]
    assert [(m.id, e.code) for m, e in report.rejected] == [("m1", "body_too_large")]
    assert [m.id for m in report.unsent] == ["m4"]
    assert str(report.error) == "no PubAck"
    assert str(rejected) == "rejected (body_too_large): JetStream: big"


def test_key_order_one_key_at_a_time_and_nothing_after_a_failure() -> None:
    messages = [msg(0, "a"), msg(1, "b"), msg(2, "a"), msg(3), msg(4, "a"), msg(5, "b")]
    published: list[str] = []

    async def publish(message: OutgoingMessage) -> Outcome:
        published.append(message.id)
        await asyncio.sleep(0)
        if message.id == "m2":
            return BrokerUnavailable("timeout")
        return stored(message)

    outcomes = asyncio.run(publish_in_key_order(messages, publish))
    statuses = [getattr(o, "status", type(o).__name__) for o in outcomes]
    assert statuses == [
        "stored",
        "stored",
        "BrokerUnavailable",
        "stored",
        "BrokerUnavailable",
        "stored",
    ]
    assert "m4" not in published  # after m2 of its key failed, never sent
    assert published.index("m0") < published.index("m2")
    assert published.index("m1") < published.index("m5")
    assert "earlier one of its key" in str(outcomes[4])


def test_the_default_retry_delays_are_the_brokers() -> None:
    assert [retry_delay(n) for n in (0, 1, 2, 3, 10, 99)] == [1, 1, 5, 10, 3600, 3600]
