"""RabbitMQ connections and the topology of a group: exchange, queues, bindings; the
declared groups' topology (``RabbitMqTransport.groups``).

aio-pika's plain connection: once it closes, the next use makes a new one (a robust
connection would restore consumers behind our back, and deliveries of the lost channel
must not be acked on the new one). Driver errors become ``BrokerUnavailable`` here.
"""

from __future__ import annotations

from typing import Any

import aio_pika
import aio_pika.abc
from aio_pika.exceptions import CONNECTION_EXCEPTIONS

from qmq_outbox.errors import BrokerUnavailable
from qmq_outbox.transports.rabbitmq.config import RabbitMqTransport

FAILURES = (*CONNECTION_EXCEPTIONS, TimeoutError)


async def connect(transport: RabbitMqTransport) -> aio_pika.abc.AbstractConnection:
    try:
        return await aio_pika.connect(
            transport.url, timeout=transport.connect_timeout.total_seconds()
        )
    except FAILURES as exc:
        raise BrokerUnavailable(f"RabbitMQ at {transport.base_url} unreachable: {exc!r}") from exc


async def probe(transport: RabbitMqTransport) -> None:
    connection = await connect(transport)
    await connection.close()


async def declare_exchange(
    channel: aio_pika.abc.AbstractChannel, transport: RabbitMqTransport
) -> aio_pika.abc.AbstractExchange:
    return await channel.declare_exchange(
        transport.exchange, aio_pika.ExchangeType.TOPIC, durable=True
    )


def _queue_arguments(transport: RabbitMqTransport, dead_letter_to: str | None) -> dict[str, Any]:
    """A queue's arguments: quorum (unless classic), dead-lettering to the queue named."""
    arguments: dict[str, Any] = {}
    if transport.queue_type == "quorum":
        arguments["x-queue-type"] = "quorum"
    if dead_letter_to is not None:
        arguments["x-dead-letter-exchange"] = ""  # the default exchange: by queue name
        arguments["x-dead-letter-routing-key"] = dead_letter_to
        if transport.queue_type == "quorum":  # keep it until its new queue has it
            arguments["x-dead-letter-strategy"] = "at-least-once"
            arguments["x-overflow"] = "reject-publish"
    return arguments


async def declare_group(
    channel: aio_pika.abc.AbstractChannel,
    exchange: aio_pika.abc.AbstractExchange,
    transport: RabbitMqTransport,
    group: str,
    subject: str,
) -> aio_pika.abc.AbstractQueue:
    """The group's queue of ``subject`` bound to the exchange, with its retry and dead-letter
    queues; returns the queue. A message past ``max_attempts`` deliveries (a consumer dying
    with it) is dead-lettered by RabbitMQ itself (``x-delivery-limit``, quorum queues)."""
    name = transport.queue_name(group, subject)
    dead = f"{name}.dead"
    await channel.declare_queue(dead, durable=True, arguments=_queue_arguments(transport, None))
    arguments = _queue_arguments(transport, dead)
    if transport.queue_type == "quorum":
        arguments["x-delivery-limit"] = transport.max_attempts
    queue = await channel.declare_queue(name, durable=True, arguments=arguments)
    retry = _queue_arguments(transport, name)  # per-message TTL, then back to the queue
    await channel.declare_queue(f"{name}.retry", durable=True, arguments=retry)
    await queue.bind(exchange, routing_key=subject)
    return queue


async def declare_groups(
    channel: aio_pika.abc.AbstractChannel,
    exchange: aio_pika.abc.AbstractExchange,
    transport: RabbitMqTransport,
) -> list[str]:
    """The queues of every group ``transport`` declares (``groups``); returns their names."""
    names = []
    for group, subject in transport.declared:
        queue = await declare_group(channel, exchange, transport, group, subject)
        names.append(queue.name)
    return names


async def declare_topology(transport: RabbitMqTransport) -> list[str]:
    """Declare the exchange and the declared groups' queues on a connection of its own."""
    connection = await connect(transport)
    try:
        channel = await connection.channel()
        exchange = await declare_exchange(channel, transport)
        queues = await declare_groups(channel, exchange, transport)
    except FAILURES as exc:
        raise BrokerUnavailable(f"RabbitMQ at {transport.base_url}: {exc!r}") from exc
    finally:
        await connection.close()
    found = [f"exchange {transport.exchange} (topic)"]
    return found + [f"queue {name} bound to {transport.exchange}" for name in queues]
