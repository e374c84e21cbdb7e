"""The ORM mapping ``publish()`` adds through the caller's session.

Mapped on a private registry so it never touches the application's declarative base. Adding
an object (instead of executing an INSERT) works the same for ``Session`` and
``AsyncSession``: the row is flushed by the caller's next flush or commit, inside the
transaction (or savepoint) that was current when it was published.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import registry

from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.schema import outbox_table

_registry = registry()


class OutboxRow:
    """One ``qmq_outbox`` row as the ORM sees it (write-only for the SDK)."""

    id: int
    message_id: str
    subject: str
    key: str | None
    headers: dict[str, str]
    body: bytes
    content_type: str
    producer: str | None
    deliver_at: datetime | None
    status: str
    attempts: int
    next_attempt_at: datetime
    created_at: datetime

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self, name, value)


OUTBOX_MAPPER = _registry.map_imperatively(OutboxRow, outbox_table)


def row_for(message: OutgoingMessage, content_type: str) -> OutboxRow:
    """A pending row for ``message``; due immediately (the compensator adds its grace)."""
    assert message.created_at is not None
    return OutboxRow(
        message_id=message.id,
        subject=message.subject,
        key=message.key,
        headers=message.headers,
        body=message.body,
        content_type=content_type,
        producer=message.producer,
        deliver_at=message.deliver_at,
        status="pending",
        attempts=0,
        next_attempt_at=message.created_at,
        created_at=message.created_at,
    )
