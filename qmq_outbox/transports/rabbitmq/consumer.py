"""The RabbitMQ consumer client: a ``PullClient`` over the group's queues.

At the first pull it connects, opens one confirming channel with ``prefetch`` = the
consumer's capacity, declares the group's queues (``connection.declare_group``) and
consumes them with manual ack into one inbox per subject; ``pull`` takes from the inbox.
A delivery's ``seq`` is a number of this client (AMQP delivery tags restart on a new
channel, and an ack must never reach another message); deliveries of a lost channel come
again from RabbitMQ and their seqs answer ``unknown``.

- attempt = 1 + retries so far (header ``qmq-retries``) + redeliveries (quorum queues'
  ``x-delivery-count``: a consumer died with it).
- ``nack``: a copy goes to ``<queue>.retry`` with the delay as its TTL (dead-lettered
  back to the queue when due; at once to the queue for no delay), then the original is
  acked; at the last attempt the copy goes to ``<queue>.dead`` with its error instead.
  If that publish fails, the original is requeued (a redelivery, counted).
- RabbitMQ has no lease: a message held by a consumer comes back when its connection
  closes (a crash, ``kill -9``), or at the server's ``consumer_timeout``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aio_pika
import aio_pika.abc

from qmq_outbox.calls import Position
from qmq_outbox.envelope import Message
from qmq_outbox.errors import BrokerUnavailable
from qmq_outbox.transports import headers
from qmq_outbox.transports.base import (
    ConsumerSpec,
    DeadLetter,
    LeasingConsumer,
    named_start,
    retry_delay,
)
from qmq_outbox.transports.rabbitmq.config import RabbitMqTransport
from qmq_outbox.transports.rabbitmq.connection import (
    FAILURES,
    connect,
    declare_exchange,
    declare_group,
)

logger = logging.getLogger(__name__)

Incoming = aio_pika.abc.AbstractIncomingMessage
EXPIRED = "delivered more than max_attempts times (its consumers died with it)"


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    subject: str
    incoming: Incoming
    attempt: int


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def attempt_of(incoming: Incoming) -> int:
    fields = incoming.headers or {}
    retries = int(_text(fields.get(headers.RETRIES, 0)) or 0)
    count = fields.get("x-delivery-count")
    redeliveries = int(_text(count)) if count is not None else int(incoming.redelivered or 0)
    return 1 + retries + redeliveries


def own_headers(incoming: Incoming) -> dict[str, str]:
    """The message's headers without RabbitMQ's (``x-...``)."""
    fields = incoming.headers or {}
    return {name: _text(value) for name, value in fields.items() if not name.startswith("x-")}


class RabbitMqConsumer(LeasingConsumer):
    """The ``PullClient`` of one consumer of ``spec.group`` (see the module docstring)."""

    def __init__(self, transport: RabbitMqTransport, spec: ConsumerSpec) -> None:
        self.transport = transport
        self.spec = spec
        self.base_url = transport.base_url
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._inboxes: dict[str, asyncio.Queue[Incoming]] = {}
        self._leases: dict[int, Lease] = {}
        self._seqs = itertools.count(1)
        self._lock = asyncio.Lock()

    async def aclose(self) -> None:
        """Close the connection: what this consumer held goes back to its queues."""
        connection, self._connection, self._channel = self._connection, None, None
        self._leases.clear()
        if connection is not None and not connection.is_closed:
            await connection.close()

    async def _open(self) -> aio_pika.abc.AbstractChannel:
        async with self._lock:
            channel = self._channel
            if channel is not None and not channel.is_closed and self._connected():
                return channel
            await self.aclose()  # whatever it held comes again from RabbitMQ
            self._connection = connection = await connect(self.transport)
            try:
                channel = await connection.channel(publisher_confirms=True)
                await channel.set_qos(prefetch_count=max(1, self.spec.capacity))
                exchange = await declare_exchange(channel, self.transport)
                inboxes: dict[str, asyncio.Queue[Incoming]] = {}
                for subject in self.spec.subjects:
                    queue = await declare_group(
                        channel, exchange, self.transport, self.spec.group, subject
                    )
                    inbox = inboxes[subject] = asyncio.Queue()
                    await queue.consume(_deliver_to(inbox))
            except FAILURES as exc:
                await self.aclose()
                raise BrokerUnavailable(f"RabbitMQ queues of {self.spec.group}: {exc!r}") from exc
            self._channel, self._inboxes = channel, inboxes
            return channel

    def _connected(self) -> bool:
        return self._connection is not None and not self._connection.is_closed

    # -- pulling ---------------------------------------------------------------------------

    async def _fetch(
        self, subject: str, max_messages: int, wait_ms: int, start: Position
    ) -> list[Message]:
        named_start(start, "RabbitMQ")
        await self._open()
        inbox = self._inboxes[subject]
        taken: list[Incoming] = []
        if inbox.empty() and wait_ms > 0:
            try:
                taken.append(await asyncio.wait_for(inbox.get(), wait_ms / 1000))
            except TimeoutError:
                return []
        while len(taken) < max_messages and not inbox.empty():
            taken.append(inbox.get_nowait())
        messages: list[Message] = []
        for incoming in taken:
            lease = Lease(subject, incoming, attempt_of(incoming))
            if lease.attempt > self.transport.max_attempts:
                await self._dead_letter(lease, EXPIRED)
                continue
            seq = next(self._seqs)
            self._leases[seq] = lease
            messages.append(_message(lease, seq))
        return messages

    # -- finishing -------------------------------------------------------------------------

    async def _ack(self, subject: str, seqs: Sequence[int]) -> tuple[int, list[int]]:
        acked, unknown = 0, []
        for seq in seqs:
            lease = self._take(subject, seq)
            if lease is None or not await _settle(lease.incoming.ack):
                unknown.append(seq)  # its channel is gone: RabbitMQ delivers it again
            else:
                acked += 1
        return acked, unknown

    async def _nack(
        self, subject: str, seqs: Sequence[int], delay_ms: int | None, error: str | None
    ) -> tuple[int, int]:
        retrying = dead = 0
        for seq in seqs:
            lease = self._take(subject, seq)
            if lease is None:
                continue
            if lease.attempt >= self.transport.max_attempts:
                await self._dead_letter(lease, error)
                dead += 1
                continue
            delay = delay_ms / 1000 if delay_ms is not None else retry_delay(lease.attempt)
            await self._retry(lease, delay, error)
            retrying += 1
        return retrying, dead

    def _take(self, subject: str, seq: int) -> Lease | None:
        lease = self._leases.get(seq)
        if lease is None or lease.subject != subject:
            return None
        del self._leases[seq]
        return lease

    async def _retry(self, lease: Lease, delay: float, error: str | None) -> None:
        queue = self.transport.queue_name(self.spec.group, lease.subject)
        extra = {headers.RETRIES: str(lease.attempt), headers.ERROR: headers.clip_error(error)}
        copy = _copy(lease.incoming, extra, expiration=delay if delay > 0 else None)
        await self._republish(lease, copy, f"{queue}.retry" if delay > 0 else queue)

    async def _dead_letter(self, lease: Lease, error: str | None) -> None:
        queue = self.transport.queue_name(self.spec.group, lease.subject)
        message_id = lease.incoming.message_id or ""
        extra = {
            headers.ID: message_id,
            headers.SUBJECT: lease.subject,
            headers.GROUP: self.spec.group,
            headers.ATTEMPTS: str(min(lease.attempt, self.transport.max_attempts)),
            headers.ERROR: headers.clip_error(error),
        }
        if await self._republish(lease, _copy(lease.incoming, extra), f"{queue}.dead"):
            logger.warning(
                "consumer group %s: message %s of subject %s dead after %d attempt(s): %s",
                self.spec.group,
                message_id,
                lease.subject,
                lease.attempt,
                error,
                extra={
                    "action": "rabbitmq.dead_letter",
                    "message_id": message_id,
                    "subject": lease.subject,
                    "group": self.spec.group,
                },
            )

    async def _republish(self, lease: Lease, copy: aio_pika.Message, queue: str) -> bool:
        """Publish ``copy`` to ``queue`` (confirmed), then ack the original; if the publish
        fails, requeue the original instead (False)."""
        try:
            channel = await self._open()
            await channel.default_exchange.publish(
                copy, routing_key=queue, timeout=self.transport.publish_timeout.total_seconds()
            )
        except (BrokerUnavailable, *FAILURES):
            logger.debug("republish to %s failed; requeued", queue, exc_info=True)
            await _settle(lambda: lease.incoming.nack(requeue=True))
            return False
        await _settle(lease.incoming.ack)
        return True

    async def dead_letters(self, subject: str, *, limit: int = 100) -> list[DeadLetter]:
        """This group's dead letters of ``subject``, oldest first (read, then put back)."""
        queue_name = f"{self.transport.queue_name(self.spec.group, subject)}.dead"
        connection = await connect(self.transport)
        found: list[DeadLetter] = []
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(queue_name, passive=True)
            while len(found) < limit:
                incoming = await queue.get(no_ack=False, fail=False)
                if incoming is None:
                    break
                fields = own_headers(incoming)
                found.append(
                    DeadLetter(
                        id=incoming.message_id or fields.get(headers.ID, ""),
                        subject=subject,
                        group=self.spec.group,
                        attempts=int(fields.get(headers.ATTEMPTS) or 0),
                        error=fields.get(headers.ERROR),
                        body=incoming.body,
                        headers=headers.decode(fields).headers,
                    )
                )
        except FAILURES as exc:
            raise BrokerUnavailable(f"RabbitMQ dead letters {queue_name}: {exc!r}") from exc
        finally:
            await connection.close()  # unacked: they stay in the queue
        return found


def _deliver_to(
    inbox: asyncio.Queue[Incoming],
) -> Callable[[Incoming], Awaitable[None]]:
    async def deliver(incoming: Incoming) -> None:
        inbox.put_nowait(incoming)

    return deliver


async def _settle(step: Callable[[], Awaitable[Any]]) -> bool:
    """Ack or nack; False when its channel is gone (RabbitMQ delivers it again)."""
    try:
        await step()
    except FAILURES:
        return False
    return True


def _copy(
    incoming: Incoming, extra: dict[str, str], *, expiration: float | None = None
) -> aio_pika.Message:
    """A new message with ``incoming``'s body, id and headers plus ``extra``."""
    return aio_pika.Message(
        incoming.body,
        headers=dict(own_headers(incoming) | extra),
        message_id=incoming.message_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=incoming.timestamp,
        app_id=incoming.app_id,
        expiration=expiration,
    )


def _message(lease: Lease, seq: int) -> Message:
    incoming = lease.incoming
    return headers.decode(own_headers(incoming)).message(
        id=incoming.message_id or f"amqp-{seq}",
        subject=lease.subject,
        seq=seq,
        attempt=lease.attempt,
        body=incoming.body,
        stored_at=None,
    )
