"""The envelope's fields as message headers, for transports without them (JetStream,
RabbitMQ). Header names starting with ``qmq-`` are the SDK's; the message id travels in
the transport's own field (``Nats-Msg-Id``, AMQP ``message_id``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime

from qmq_outbox.envelope import Message, OutgoingMessage, format_timestamp, parse_timestamp

KEY = "qmq-key"
PRODUCER = "qmq-producer"
CREATED_AT = "qmq-created-at"
ERROR = "qmq-error"  # a dead letter's last error
ATTEMPTS = "qmq-attempts"  # a dead letter's attempts
GROUP = "qmq-group"  # the group that dead-lettered it
SUBJECT = "qmq-subject"  # a dead letter's own subject
ID = "qmq-id"  # a dead letter's message id
RETRIES = "qmq-retries"  # RabbitMQ: the attempts before this copy of a retried message
TAGS = "qmq-tags"  # the message's tags joined by "," (a tag has no comma)
RESERVED = (KEY, PRODUCER, CREATED_AT, ERROR, ATTEMPTS, GROUP, SUBJECT, ID, RETRIES, TAGS)
MAX_ERROR_CHARS = 2000  # as the qmq broker keeps a dead letter's error


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """The envelope fields read back from a delivered message's headers."""

    headers: dict[str, str]  # the publisher's own headers
    key: str | None
    producer: str | None
    created_at: datetime | None
    tags: tuple[str, ...] = ()

    def message(
        self,
        *,
        id: str,
        subject: str,
        seq: int,
        attempt: int,
        body: bytes,
        stored_at: datetime | None,
    ) -> Message:
        """The delivered message these headers came with, as the SDK hands it to a handler."""
        return Message(
            id=id,
            subject=subject,
            seq=seq,
            attempt=attempt,
            key=self.key,
            headers=self.headers,
            body=body,
            producer=self.producer,
            created_at=self.created_at,
            stored_at=stored_at,
            tags=self.tags,
        )


def encode(message: OutgoingMessage) -> dict[str, str]:
    """The message's headers with its key, producer, creation time and tags added."""
    headers = dict(message.headers)
    if message.key is not None:
        headers[KEY] = message.key
    if message.producer is not None:
        headers[PRODUCER] = message.producer
    if message.created_at is not None:
        headers[CREATED_AT] = format_timestamp(message.created_at)
    if message.tags:
        headers[TAGS] = ",".join(message.tags)
    return headers


def decode(headers: Mapping[str, str]) -> Envelope:
    """``encode`` undone; other ``qmq-`` headers (a dead letter's) are dropped."""
    created = headers.get(CREATED_AT)
    try:
        created_at = parse_timestamp(created) if created else None
    except ValueError:  # written by someone else: not ours to judge
        created_at = None
    own = {name: value for name, value in headers.items() if name not in RESERVED}
    return Envelope(
        headers=own,
        key=headers.get(KEY),
        producer=headers.get(PRODUCER),
        created_at=created_at,
        tags=tuple(tag for tag in headers.get(TAGS, "").split(",") if tag),
    )


def clip_error(error: str | None) -> str:
    """An error as one header line (NATS headers cannot hold line breaks), clipped."""
    return " ".join((error or "").split())[:MAX_ERROR_CHARS]
