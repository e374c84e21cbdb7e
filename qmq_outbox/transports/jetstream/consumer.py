"""The JetStream consumer client: a ``PullClient`` over durable pull consumers.

Each (group, subject) has a durable pull consumer (explicit ack, AckWait = the transport's
``lease``), made on the first pull of the subject unless declared before (``durables``). A
pulled message's ``seq`` is its stream sequence; the client keeps its reply subject until
it is acked or nacked.

- ``ack``: ``+ACK`` for each, then one flush (the server has them when it answers).
- ``nack``: ``-NAK`` with the delay (the handler's, else the qmq broker's backoff by
  attempt); at the last attempt the message is republished to ``<dead_prefix>.<subject>``
  with its error, attempts and group as headers, then terminated (``+TERM``): dead letters
  without an advisory listener.
- MaxDeliver is ``max_attempts + 1``: a message whose lease ran out on its last attempt
  (its consumer died) comes once more and is dead-lettered by the pull, unhandled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from qmq_outbox.calls import Position, StartAt
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
from qmq_outbox.transports.jetstream.config import JetStreamTransport
from qmq_outbox.transports.jetstream.connection import Connection
from qmq_outbox.transports.jetstream.durables import ensure_durable
from qmq_outbox.transports.jetstream.producer import MSG_ID
from qmq_outbox.transports.jetstream.streams import Streams, read_stream

logger = logging.getLogger(__name__)

MIN_WAIT = 0.05  # seconds: nats-py needs a fetch timeout; "no wait" waits this long
EXPIRED = "lease expired on the last attempt"


class JetStreamConsumer(LeasingConsumer):
    """The ``PullClient`` of one consumer of ``spec.group`` (see the module docstring)."""

    def __init__(self, transport: JetStreamTransport, spec: ConsumerSpec) -> None:
        self.transport = transport
        self.spec = spec
        self.base_url = transport.base_url
        self._connection = Connection(transport)
        self._streams = Streams(transport, self._connection)
        self._subscriptions: dict[str, JetStreamContext.PullSubscription] = {}
        self._leases: dict[str, dict[int, Msg]] = {}

    @classmethod
    async def open(cls, transport: JetStreamTransport, spec: ConsumerSpec) -> JetStreamConsumer:
        """The client; it connects on its first pull (an unreachable server is then retried
        like any outage)."""
        return cls(transport, spec)

    async def aclose(self) -> None:
        self._subscriptions.clear()
        self._leases.clear()
        await self._connection.close()

    # -- pulling ---------------------------------------------------------------------------

    async def _fetch(
        self, subject: str, max_messages: int, wait_ms: int, start: Position
    ) -> list[Message]:
        subscription = await self._subscription(subject, named_start(start, "JetStream"))
        client = await self._connection.client()
        if not client.is_connected:  # reconnecting: a fetch would only wait and time out
            raise BrokerUnavailable(f"NATS at {self.base_url}: connection lost, reconnecting")
        try:
            fetched = await subscription.fetch(max_messages, timeout=max(wait_ms / 1000, MIN_WAIT))
        except TimeoutError:  # nats-py's way to say "nothing came"
            return []
        except nats.errors.Error as exc:
            self._subscriptions.pop(subject, None)  # its consumer may be gone: made again
            raise BrokerUnavailable(f"JetStream fetch of {subject}: {exc!r}") from exc
        leases = self._leases.setdefault(subject, {})
        messages: list[Message] = []
        for msg in fetched:
            metadata = msg.metadata
            if metadata.num_delivered > self.transport.max_attempts:
                try:
                    await self._dead_letter(subject, msg, EXPIRED, metadata.num_delivered - 1)
                except BrokerUnavailable:  # its lease runs out and it comes back: again then
                    logger.debug("dead letter deferred", exc_info=True)
                continue
            leases[metadata.sequence.stream] = msg
            messages.append(_message(msg))
        return messages

    async def _subscription(
        self, subject: str, start: StartAt
    ) -> JetStreamContext.PullSubscription:
        subscription = self._subscriptions.get(subject)
        if subscription is not None:
            return subscription
        stream = await self._streams.ensure(subject)
        js = await self._connection.jetstream()
        durable = await ensure_durable(js, self.transport, stream, self.spec.group, subject, start)
        try:
            subscription = await js.pull_subscribe_bind(durable=durable, stream=stream)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BrokerUnavailable(f"JetStream consumer {durable} on {stream}: {exc!r}") from exc
        self._subscriptions[subject] = subscription
        return subscription

    # -- finishing -------------------------------------------------------------------------

    async def _ack(self, subject: str, seqs: Sequence[int]) -> tuple[int, list[int]]:
        leases = self._leases.get(subject, {})
        held = [seq for seq in seqs if seq in leases]
        unknown = [seq for seq in seqs if seq not in leases]
        await self._reply(subject, {seq: b"+ACK" for seq in held})
        return len(held), unknown

    async def _nack(
        self, subject: str, seqs: Sequence[int], delay_ms: int | None, error: str | None
    ) -> tuple[int, int]:
        leases = self._leases.get(subject, {})
        replies: dict[int, bytes] = {}
        dead = 0
        for seq in seqs:
            msg = leases.get(seq)
            if msg is None:
                continue
            attempt = msg.metadata.num_delivered
            if attempt >= self.transport.max_attempts:
                await self._dead_letter(subject, msg, error, attempt)
                leases.pop(seq, None)
                dead += 1
                continue
            delay = delay_ms / 1000 if delay_ms is not None else retry_delay(attempt)
            replies[seq] = _nak(delay)
        await self._reply(subject, replies)
        return len(replies), dead

    async def _reply(self, subject: str, replies: dict[int, bytes]) -> None:
        """Send each leased message's answer, flush, and forget the leases."""
        if not replies:
            return
        leases = self._leases.get(subject, {})
        client = await self._connection.client()
        try:
            for seq, payload in replies.items():
                await client.publish(leases[seq].reply, payload)
            await client.flush(
                timeout=max(1, round(self.transport.publish_timeout.total_seconds()))
            )
        except (TimeoutError, nats.errors.Error) as exc:
            # Kept: a retry sends them again (a second +ACK of a message is harmless).
            raise BrokerUnavailable(f"JetStream acks of {subject}: {exc!r}") from exc
        for seq in replies:
            leases.pop(seq, None)

    async def _dead_letter(self, subject: str, msg: Msg, error: str | None, attempts: int) -> None:
        """Republish ``msg`` to the dead letters with why, then end its deliveries."""
        original = dict(msg.headers or {})
        message_id = original.get(MSG_ID, f"{msg.metadata.stream}:{msg.metadata.sequence.stream}")
        dead = original | {
            MSG_ID: f"{message_id}@{self.spec.group}",  # one dead letter per group
            headers.ID: message_id,
            headers.SUBJECT: subject,
            headers.GROUP: self.spec.group,
            headers.ATTEMPTS: str(attempts),
            headers.ERROR: headers.clip_error(error),
        }
        try:
            await self._streams.ensure_dead()
            js = await self._connection.jetstream()
            await js.publish(
                self.transport.dead_subject(subject),
                msg.data,
                timeout=self.transport.publish_timeout.total_seconds(),
                headers=dead,
            )
            await msg.term()
        except (TimeoutError, nats.errors.Error) as exc:
            # The message stays leased: it comes back after the lease and is tried again.
            raise BrokerUnavailable(f"JetStream dead letter of {message_id}: {exc!r}") from exc
        logger.warning(
            "consumer group %s: message %s of subject %s dead after %d attempt(s): %s",
            self.spec.group,
            message_id,
            subject,
            attempts,
            error,
            extra={
                "action": "jetstream.dead_letter",
                "message_id": message_id,
                "subject": subject,
                "group": self.spec.group,
            },
        )

    async def dead_letters(self, subject: str, *, limit: int = 100) -> list[DeadLetter]:
        """This group's dead letters of ``subject``, oldest first."""
        stream = await self._streams.ensure_dead()
        js = await self._connection.jetstream()
        found: list[DeadLetter] = []
        for msg in await read_stream(js, stream, self.transport.dead_subject(subject)):
            fields = dict(msg.headers or {})
            if fields.get(headers.GROUP) != self.spec.group:
                continue
            found.append(
                DeadLetter(
                    id=fields.get(headers.ID, ""),
                    subject=subject,
                    group=self.spec.group,
                    attempts=int(fields.get(headers.ATTEMPTS, "0")),
                    error=fields.get(headers.ERROR),
                    body=msg.data,
                    headers=headers.decode(fields).headers,
                )
            )
        return found[:limit]


def _nak(delay: float) -> bytes:
    if delay <= 0:
        return b"-NAK"
    return b"-NAK " + json.dumps({"delay": int(delay * 1_000_000_000)}).encode()


def _message(msg: Msg) -> Message:
    metadata = msg.metadata
    fields = dict(msg.headers or {})
    message_id = fields.pop(MSG_ID, None) or f"{metadata.stream}:{metadata.sequence.stream}"
    return headers.decode(fields).message(
        id=message_id,
        subject=msg.subject,
        seq=metadata.sequence.stream,
        attempt=metadata.num_delivered,
        body=msg.data,
        stored_at=metadata.timestamp,
    )
