"""Message envelopes as the SDK sends and receives them (docs/architecture.md §2)."""

from __future__ import annotations

import base64
import dataclasses
from datetime import UTC, datetime
from typing import Any

import orjson


def format_timestamp(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds, as on the wire."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def parse_timestamp(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)


def encode_body(body: bytes) -> tuple[str, str]:
    """Wire form of a body: UTF-8 text when it is, base64 otherwise."""
    try:
        return body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(body).decode("ascii"), "base64"


def decode_body(text: str, encoding: str) -> bytes:
    if encoding == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OutgoingMessage:
    """A message to produce."""

    id: str
    subject: str
    body: bytes
    key: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    producer: str | None = None
    created_at: datetime | None = None
    deliver_at: datetime | None = None

    def to_wire(self) -> dict[str, Any]:
        text, encoding = encode_body(self.body)
        wire: dict[str, Any] = {
            "id": self.id,
            "subject": self.subject,
            "body": text,
            "body_encoding": encoding,
        }
        if self.key is not None:
            wire["key"] = self.key
        if self.headers:
            wire["headers"] = self.headers
        if self.producer is not None:
            wire["producer"] = self.producer
        if self.created_at is not None:
            wire["created_at"] = format_timestamp(self.created_at)
        if self.deliver_at is not None:
            wire["deliver_at"] = format_timestamp(self.deliver_at)
        return wire


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProduceResult:
    """The broker's answer for one produced message."""

    id: str
    subject: str
    status: str  # "stored" | "duplicate" | "scheduled"
    seq: int | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """A message delivered to a consumer."""

    id: str
    subject: str
    seq: int
    attempt: int
    key: str | None
    headers: dict[str, str]
    body: bytes
    producer: str | None
    created_at: datetime | None
    stored_at: datetime | None

    def json(self) -> Any:
        """The body parsed as JSON (the SDK's default serializer)."""
        return orjson.loads(self.body)

    def text(self) -> str:
        return self.body.decode("utf-8")

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Message:
        created = wire.get("created_at")
        stored = wire.get("stored_at")
        return cls(
            id=wire["id"],
            subject=wire["subject"],
            seq=int(wire["seq"]),
            attempt=int(wire["attempt"]),
            key=wire.get("key"),
            headers=dict(wire.get("headers") or {}),
            body=decode_body(wire["body"], wire.get("body_encoding", "utf-8")),
            producer=wire.get("producer"),
            created_at=parse_timestamp(created) if created else None,
            stored_at=parse_timestamp(stored) if stored else None,
        )
