"""The RabbitMQ producer: persistent messages to the topic exchange, each awaited as a
publisher confirm.

Outcomes: ``stored`` on the broker's ack (quorum queues confirm once a majority has the
message on disk); ``rejected`` for a delayed message and, with ``mandatory``, for one no
queue is bound for (RabbitMQ returns it); ``transient`` (``BrokerUnavailable``) on a nack,
a timeout or a lost connection. RabbitMQ has no dedup: a resend is stored again and the
idempotent consumer drops it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aio_pika
import aio_pika.abc
from aio_pika.exceptions import DeliveryError, PublishError

from qmq_outbox.envelope import OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable
from qmq_outbox.transports import headers
from qmq_outbox.transports.base import Outcome
from qmq_outbox.transports.keyorder import publish_in_key_order
from qmq_outbox.transports.rabbitmq.config import RabbitMqTransport
from qmq_outbox.transports.rabbitmq.connection import (
    FAILURES,
    connect,
    declare_exchange,
    declare_groups,
)

DELAY_UNSUPPORTED = (
    "RabbitMQ has no scheduled delivery here: publish without delay/deliver_at, or use the "
    "qmq broker (docs/transports.md)"
)


def rejected(code: str, message: str) -> BrokerRejected:
    return BrokerRejected(status=None, code=code, message=f"RabbitMQ: {message}")


def outgoing(message: OutgoingMessage) -> aio_pika.Message:
    """The AMQP message of an outbox message."""
    return aio_pika.Message(
        message.body,
        headers=dict(headers.encode(message)),
        message_id=message.id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=message.created_at,
        app_id=message.producer,
    )


class RabbitMqProducer:
    """An ``AsyncProducer`` on one connection and confirming channel (made on first use)."""

    def __init__(self, transport: RabbitMqTransport) -> None:
        self.transport = transport
        self.base_url = transport.base_url
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._lock = asyncio.Lock()

    async def produce(self, messages: Sequence[OutgoingMessage]) -> Sequence[Outcome]:
        try:
            exchange = await self._open()
        except BrokerUnavailable as exc:
            return [exc] * len(messages)
        return await publish_in_key_order(messages, lambda m: self._publish(exchange, m))

    async def _open(self) -> aio_pika.abc.AbstractExchange:
        async with self._lock:
            if self._connection is None or self._connection.is_closed:
                self._connection = await connect(self.transport)
                self._channel = None
            if self._channel is None or self._channel.is_closed or self._exchange is None:
                try:
                    self._channel = await self._connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
                    exchange = await declare_exchange(self._channel, self.transport)
                    # Before the first publish: what it publishes has the groups' queues.
                    await declare_groups(self._channel, exchange, self.transport)
                    self._exchange = exchange
                except FAILURES as exc:
                    raise BrokerUnavailable(f"RabbitMQ channel: {exc!r}") from exc
            return self._exchange

    async def _publish(
        self, exchange: aio_pika.abc.AbstractExchange, message: OutgoingMessage
    ) -> Outcome:
        if message.deliver_at is not None:
            return rejected("delay_not_supported", DELAY_UNSUPPORTED)
        try:
            await exchange.publish(
                outgoing(message),
                routing_key=message.subject,
                mandatory=self.transport.mandatory,
                timeout=self.transport.publish_timeout.total_seconds(),
            )
        except PublishError:
            return rejected(
                "unroutable",
                f"no queue is bound for subject {message.subject} on exchange "
                f"{self.transport.exchange}: start the consumer groups first (they declare "
                "their queues)",
            )
        except DeliveryError as exc:
            return BrokerUnavailable(f"RabbitMQ did not confirm {message.id}: {exc!r}")
        except FAILURES as exc:
            return BrokerUnavailable(f"RabbitMQ: no confirm for {message.id}: {exc!r}")
        return ProduceResult(id=message.id, subject=message.subject, status="stored", seq=None)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._exchange = None
        if connection is not None and not connection.is_closed:
            await connection.close()
