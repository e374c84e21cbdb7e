"""RabbitMQ through aio-pika: a durable queue (classic or quorum), persistent messages,
publisher confirms; consumed with ``basic.consume``, a prefetch of one batch, and one
``multiple`` ack per batch (AMQP's way to take messages in batches)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import psutil
from aio_pika.abc import (
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
)

from bench._peers.common import Inbox, processes_named, version_of


class RabbitProducer:
    def __init__(self, exchange: AbstractExchange, queue: str) -> None:
        self._exchange = exchange
        self._queue = queue

    async def send(self, bodies: Sequence[bytes]) -> None:
        # a batch: every publish in flight at once, then wait for all their confirms
        await asyncio.gather(
            *(
                self._exchange.publish(
                    aio_pika.Message(b, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=self._queue,
                )
                for b in bodies
            )
        )


class RabbitConsumer:
    def __init__(self) -> None:
        self.inbox: Inbox[AbstractIncomingMessage] = Inbox()
        self._last: AbstractIncomingMessage | None = None

    async def deliver(self, message: AbstractIncomingMessage) -> None:
        self.inbox.put(message)

    async def take(self, max_messages: int, wait: float) -> list[bytes]:
        messages = await self.inbox.take(max_messages, wait)
        self._last = messages[-1] if messages else None
        return [m.body for m in messages]

    async def ack(self) -> None:
        if self._last is not None:
            await self._last.ack(multiple=True)

    async def flush(self) -> None:
        pass  # acks are sent at once


class RabbitPeer:
    """One durable queue of its own, declared by ``start`` and deleted by ``stop``."""

    def __init__(self, *, url: str, quorum: bool) -> None:
        kind = "quorum" if quorum else "classic"
        self.name = f"rabbitmq-{kind}"
        self.title = f"RabbitMQ {kind}"
        self._kind = kind
        self._url = url
        self._queue_name = f"qmq-peers-{kind}-{os.getpid()}"
        self._connection: AbstractConnection | None = None
        self._queue: AbstractQueue | None = None
        self._version = "?"

    async def start(self) -> None:
        self._connection = await aio_pika.connect(self._url)
        channel = await self._connection.channel()
        self._queue = await channel.declare_queue(
            self._queue_name, durable=True, arguments={"x-queue-type": self._kind}
        )
        self._version = _server_version(self._connection)

    async def stop(self) -> None:
        if self._queue is not None:
            await self._queue.delete(if_unused=False, if_empty=False)
        if self._connection is not None:
            await self._connection.close()

    async def reset(self) -> None:
        assert self._queue is not None
        await self._queue.purge()

    @asynccontextmanager
    async def producer(self) -> AsyncIterator[RabbitProducer]:
        connection = await aio_pika.connect(self._url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            yield RabbitProducer(channel.default_exchange, self._queue_name)

    @asynccontextmanager
    async def consumer(self, *, prefetch: int, streaming: bool) -> AsyncIterator[RabbitConsumer]:
        connection = await aio_pika.connect(self._url)
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=prefetch)
            queue = await channel.get_queue(self._queue_name, ensure=False)
            consumer = RabbitConsumer()
            tag = await queue.consume(consumer.deliver)
            try:
                yield consumer
            finally:
                await queue.cancel(tag)  # what is still unacked goes back to the queue

    def server_processes(self) -> list[psutil.Process]:
        return processes_named("beam.smp")

    def notes(self) -> list[str]:
        return [
            f"RabbitMQ {self._version} {self._kind} queue (aio-pika {version_of('aio-pika')}):"
            " durable queue, persistent messages, publisher confirms (a batch is 100"
            " publishes awaited together); consumed with `basic.consume`, prefetch 100, one"
            " `multiple` ack per batch (acks are not confirmed by the server)"
        ]


def _server_version(connection: Any) -> str:
    try:
        return str(connection.transport.connection.server_properties["version"])
    except (AttributeError, KeyError, TypeError):
        return "?"
