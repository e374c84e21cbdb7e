"""Message envelopes as the SDK sends and receives them (docs/architecture.md §2).

The records are frozen dataclasses built for batches of them (``bench/client_cpu.py``):
``__init__`` fills the instance dict in one step, not one ``object.__setattr__`` per field as
a generated frozen ``__init__`` does, which costs more per record; a decoded
answer's dicts become the records' own (``adopt``) instead of being copied into new ones;
a delivered message parses ``created_at`` / ``stored_at`` when they are first read.
"""

from __future__ import annotations

import base64
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson

from qmq_wire.ordered import split_partition_log
from qmq_wire.records import MessageFields
from qmq_wire.rules import EPOCH

_new = object.__new__
_fill = object.__setattr__  # how a frozen dataclass sets its own fields


def format_timestamp(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds, as on the wire."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    elif value.tzinfo is not UTC:  # the SDK's own timestamps are in UTC already
        value = value.astimezone(UTC)
    return value.isoformat().replace("+00:00", "Z")


def parse_timestamp(value: str) -> datetime:
    """An RFC 3339 timestamp (``Z`` or an offset) as an aware datetime in UTC."""
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo is UTC else parsed.astimezone(UTC)


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


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
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
    tags: tuple[str, ...] = ()
    """Distinct tags (``qmq_wire.TAG_PATTERN``, at most ``qmq_wire.MAX_TAGS``) a group's tag
    filter matches on."""

    def __init__(
        self,
        *,
        id: str,
        subject: str,
        body: bytes,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        producer: str | None = None,
        created_at: datetime | None = None,
        deliver_at: datetime | None = None,
        tags: tuple[str, ...] | list[str] = (),
    ) -> None:
        _fill(
            self,
            "__dict__",
            {
                "id": id,
                "subject": subject,
                "body": body,
                "key": key,
                "headers": {} if headers is None else headers,
                "producer": producer,
                "created_at": created_at,
                "deliver_at": deliver_at,
                "tags": tuple(tags),
            },
        )

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
        if self.tags:
            wire["tags"] = list(self.tags)
        return wire


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class ProduceResult:
    """The broker's answer for one produced message."""

    id: str
    subject: str
    status: str  # "stored" | "duplicate" | "scheduled"
    seq: int | None
    partition: int | None = None  # an ordered subject's partition (seqs count per partition)

    def __init__(
        self,
        *,
        id: str,
        subject: str,
        status: str,
        seq: int | None,
        partition: int | None = None,
    ) -> None:
        _fill(
            self,
            "__dict__",
            {"id": id, "subject": subject, "status": status, "seq": seq, "partition": partition},
        )

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ProduceResult:
        """One item of a produce answer (``wire`` is left as it is)."""
        return cls.adopt(dict(wire))

    @classmethod
    def adopt(cls, wire: dict[str, Any]) -> ProduceResult:
        """``from_wire`` for a dict nobody else holds (a freshly decoded answer): when it has
        exactly the fields, it becomes the result's own, not copied."""
        keys = wire.keys()
        if keys == _RESULT_KEYS:
            wire["partition"] = None
        elif keys != _ORDERED_RESULT_KEYS:
            return cls(
                id=wire["id"],
                subject=wire["subject"],
                status=wire["status"],
                seq=wire.get("seq"),
                partition=wire.get("partition"),
            )
        result = _new(cls)
        _fill(result, "__dict__", wire)
        return result


_RESULT_KEYS = frozenset(("id", "subject", "status", "seq"))
_ORDERED_RESULT_KEYS = _RESULT_KEYS | {"partition"}
_DELIVERED_KEYS = frozenset(
    (
        "id",
        "subject",
        "seq",
        "attempt",
        "key",
        "headers",
        "body",
        "body_encoding",
        "producer",
        "created_at",
        "stored_at",
    )
)
_ORDERED_KEYS = _DELIVERED_KEYS | {"partition"}  # a message of an ordered subject


# A delivered message keeps the wire text of its timestamps under these keys until they are
# first read: most handlers never read them, and parsing both costs per message.
_TIMESTAMP_TEXT = {"created_at": "_created_at_text", "stored_at": "_stored_at_text"}
# One read from a record as stored keeps their microseconds since the epoch instead.
_TIMESTAMP_US = {"created_at": "_created_at_us", "stored_at": "_stored_at_us"}


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
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
    partition: int | None = None
    """The physical partition of an ordered subject that holds it (its seq counts there)."""
    tags: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        id: str,
        subject: str,
        seq: int,
        attempt: int,
        key: str | None,
        headers: dict[str, str],
        body: bytes,
        producer: str | None,
        created_at: datetime | None,
        stored_at: datetime | None,
        partition: int | None = None,
        tags: tuple[str, ...] = (),
    ) -> None:
        _fill(
            self,
            "__dict__",
            {
                "id": id,
                "subject": subject,
                "seq": seq,
                "attempt": attempt,
                "key": key,
                "headers": headers,
                "body": body,
                "producer": producer,
                "created_at": created_at,
                "stored_at": stored_at,
                "partition": partition,
                "tags": tags,
            },
        )

    def json(self) -> Any:
        """The body parsed as JSON (the SDK's default serializer)."""
        return orjson.loads(self.body)

    def text(self) -> str:
        return self.body.decode("utf-8")

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Message:
        """A delivered message from its wire form (``wire`` is left as it is)."""
        own = dict(wire)
        if own.get("headers"):
            own["headers"] = dict(own["headers"])
        return cls.adopt(own)

    @classmethod
    def adopt(cls, wire: dict[str, Any]) -> Message:
        """``from_wire`` for a dict nobody else holds (a freshly decoded pull answer): it
        becomes the message's fields in place, its ``headers`` too. A second dict per
        message, filled and the first one freed, cost more than decoding the message.
        ``created_at`` and ``stored_at`` are parsed when first read."""
        tags = wire.pop("tags", None)
        keys = wire.keys()
        if keys == _DELIVERED_KEYS:  # a plain subject's message
            wire["partition"] = None
        elif keys != _ORDERED_KEYS:  # a field missing (or one we do not know)
            wire = {name: wire.get(name) for name in _ORDERED_KEYS} | {
                "id": wire["id"],
                "subject": wire["subject"],
                "seq": wire["seq"],
                "attempt": wire["attempt"],
                "body": wire["body"],
            }
        text = wire["body"]
        if wire.pop("body_encoding") == "base64":
            wire["body"] = base64.b64decode(text)
        else:
            wire["body"] = text.encode("utf-8")
        if wire["headers"] is None:
            wire["headers"] = {}
        created = wire.pop("created_at")
        if created:
            wire["_created_at_text"] = created
        else:
            wire["created_at"] = None
        stored = wire.pop("stored_at")
        if stored:
            wire["_stored_at_text"] = stored
        else:
            wire["stored_at"] = None
        wire["tags"] = tuple(tags) if tags else ()
        message = _new(cls)
        _fill(message, "__dict__", wire)
        return message

    @classmethod
    def from_record(cls, attempt: int, partition: int | None, fields: MessageFields) -> Message:
        """A message from its record as stored (``qmq_wire.records``: a records answer's
        entry); an ordered subject's record names its partition's log, shown as the
        subject. ``created_at`` and ``stored_at`` are made when first read."""
        seq, _, created, stored, _, subject, message_id, key, producer, headers, body, tags = fields
        if partition is not None:
            subject = split_partition_log(subject)[0]
        message = _new(cls)
        # a literal: a pull builds one per message, and it costs half of dict(zip(...))
        _fill(message, "__dict__", {
            "id": message_id, "subject": subject, "seq": seq, "attempt": attempt, "key": key,
            "headers": headers, "body": body, "producer": producer, "_created_at_us": created,
            "_stored_at_us": stored, "partition": partition, "tags": tags,
        })  # fmt: skip
        return message

    if not TYPE_CHECKING:  # for mypy, the two fields are plain attributes

        def __getattr__(self, name: str) -> Any:
            """``created_at`` / ``stored_at`` of a message read from the wire, made now."""
            fields = self.__dict__
            text_key = _TIMESTAMP_TEXT.get(name)
            if text_key is not None and text_key in fields:
                value = fields[name] = parse_timestamp(fields[text_key])
                return value
            micros_key = _TIMESTAMP_US.get(name)
            if micros_key is not None and micros_key in fields:
                value = fields[name] = EPOCH + timedelta(microseconds=fields[micros_key])
                return value
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
