"""A validated message as the HTTP layer hands it to the broker core."""

from __future__ import annotations

import base64
import dataclasses
from datetime import UTC, datetime
from typing import Any

from broker.format import MessageRecord


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IncomingMessage:
    id: str
    subject: str
    key: str | None
    headers: dict[str, str]
    body: bytes
    body_base64: bool
    producer: str | None
    created_at_us: int | None
    deliver_at_us: int


def rfc3339(micros: int) -> str:
    return (
        datetime.fromtimestamp(micros / 1_000_000, tz=UTC)
        .isoformat(timespec="microseconds")
        .replace("+00:00", "Z")
    )


def to_wire(record: MessageRecord, *, attempt: int) -> dict[str, Any]:
    """The pull response form of a stored message (ARCHITECTURE.md §3.1)."""
    if record.body_base64:
        body, encoding = base64.b64encode(record.body).decode("ascii"), "base64"
    else:
        body, encoding = record.body.decode("utf-8"), "utf-8"
    return {
        "id": record.id,
        "subject": record.subject,
        "seq": record.seq,
        "attempt": attempt,
        "key": record.key,
        "headers": record.headers,
        "body": body,
        "body_encoding": encoding,
        "producer": record.producer,
        "created_at": rfc3339(record.created_at_us),
        "stored_at": rfc3339(record.stored_at_us),
    }
