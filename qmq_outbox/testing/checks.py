"""Request checks of the in-memory broker: the broker's rules, its error codes and field names.

Each check reads a decoded JSON document and raises ``Rejected`` with what the real broker
answers for the same mistake: the first offending field in field order, then unknown fields.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import qmq_wire as wire
from qmq_wire.ordered import ON_DEAD

_MESSAGE_ID = re.compile(wire.MESSAGE_ID_PATTERN)
_CONSUMER_ID = re.compile(wire.CONSUMER_ID_PATTERN)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
Check = Callable[[Any, str], bool]
"""A field check: (value, field path) -> valid?; it may raise ``Rejected`` itself."""


class Rejected(Exception):
    """The request is answered with an error (status, code, message, offending field)."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


def invalid(name: str, field: str, message: str) -> Rejected:
    return Rejected(400, f"invalid_{name}", f"{field}: {message}", field)


def _text(value: Any, *, low: int = 0, high: int | None = None) -> bool:
    return type(value) is str and len(value) >= low and (high is None or len(value) <= high)


def _integer(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _optional(check: Check) -> Check:
    return lambda value, where: value is None or check(value, where)


def _name(value: Any, where: str) -> bool:
    return type(value) is str and wire.valid_name(value)


def _pattern(regex: re.Pattern[str]) -> Check:
    return lambda value, where: type(value) is str and regex.fullmatch(value) is not None


def _timestamp(value: Any, where: str) -> bool:
    parsed = parse_timestamp(value)
    return parsed is not None and wire.MIN_TIME_US <= micros(parsed) <= wire.MAX_TIME_US


def parse_timestamp(value: Any) -> datetime | None:
    """An aware datetime from RFC 3339 text, or None when it is not one."""
    if type(value) is not str or "T" not in value.upper():
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def micros(value: datetime) -> int:
    """Microseconds since the epoch, exact."""
    return (value - _EPOCH) // _MICROSECOND


_MICROSECOND = datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC) - _EPOCH


def _object(doc: Any, fields: Mapping[str, tuple[bool, Check]], prefix: str = "") -> None:
    """Check a JSON object: each field (required?, check) in order, then unknown fields."""
    for name, (required, check) in fields.items():
        where = f"{prefix}{name}"
        if name not in doc:
            if required:
                raise Rejected(400, "missing_field", f"{where}: Field required", where)
            continue
        if not check(doc[name], where):
            raise invalid(name, where, "invalid value")
    for name in doc:
        if name not in fields:
            where = f"{prefix}{name}"
            raise Rejected(400, "unknown_field", f"{where}: Extra inputs are not permitted", where)


def body_object(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise Rejected(400, "invalid_body", "request body must be a JSON object")
    return doc


# --- produce ---------------------------------------------------------------------------------


def _headers(doc: Any, where: str) -> bool:
    if not isinstance(doc, dict):
        return False
    for name, value in doc.items():
        if not _text(name, low=1, high=wire.MAX_HEADER_NAME) or not _text(
            value, high=wire.MAX_HEADER_VALUE
        ):
            raise invalid("headers", f"{where}.{name}", "invalid header")
    if len(doc) > wire.MAX_HEADERS:
        raise invalid("headers", where, f"at most {wire.MAX_HEADERS} headers")
    return True


_ENVELOPE: dict[str, tuple[bool, Check]] = {
    "id": (True, _pattern(_MESSAGE_ID)),
    "subject": (True, _name),
    "key": (False, _optional(lambda v, w: _text(v, high=wire.MAX_KEY))),
    "headers": (False, _headers),
    "body": (True, lambda v, w: type(v) is str),
    "body_encoding": (False, lambda v, w: v in wire.BODY_ENCODINGS),
    "producer": (False, _optional(lambda v, w: _text(v, low=1, high=wire.MAX_PRODUCER))),
    "created_at": (False, _optional(_timestamp)),
    "deliver_at": (False, _optional(_timestamp)),
}


def check_produce(doc: Any) -> list[dict[str, Any]]:
    """The envelopes of a ``POST /v1/messages`` document, all checked (all or nothing)."""
    _object(body_object(doc), {"messages": (True, _envelopes)})
    messages: list[dict[str, Any]] = doc["messages"]
    return messages


def _envelopes(messages: Any, where: str) -> bool:
    if not isinstance(messages, list) or not 1 <= len(messages) <= wire.MAX_PRODUCE_BATCH:
        return False
    for index, envelope in enumerate(messages):
        prefix = f"{where}[{index}]"
        if not isinstance(envelope, dict):
            raise invalid("messages", prefix, "Input should be an object")
        _object(envelope, _ENVELOPE, prefix=f"{prefix}.")
    return True


def decode_body(envelope: Mapping[str, Any], field: str, max_body: int) -> bytes:
    """The body's bytes; 400 for bad base64, 413 over ``max_body``."""
    if envelope.get("body_encoding", "utf-8") == "base64":
        try:
            body = base64.b64decode(envelope["body"], validate=True)
        except (binascii.Error, ValueError):
            raise Rejected(400, "invalid_body", "body is not valid base64", field) from None
    else:
        body = str(envelope["body"]).encode("utf-8")
    if len(body) > max_body:
        message = f"body is {len(body)} bytes; the limit is {max_body}"
        raise Rejected(413, "body_too_large", message, field)
    return body


# --- pull, ack, nack, redrive ------------------------------------------------------------------

_ADDRESS: dict[str, tuple[bool, Check]] = {
    "subject": (True, _name),
    "group": (True, _name),
    "consumer": (True, _pattern(_CONSUMER_ID)),
}
_PULL: dict[str, tuple[bool, Check]] = {
    **_ADDRESS,
    "max": (False, lambda v, w: _integer(v, 1, wire.MAX_PULL)),
    "wait_ms": (False, lambda v, w: _integer(v, 0, wire.MAX_WAIT_MS)),
    "mode": (False, lambda v, w: v in wire.PULL_MODES),
    "start": (False, lambda v, w: v in wire.START_POSITIONS),
}


def check_pull(doc: Any) -> dict[str, Any]:
    _object(body_object(doc), _PULL)
    defaults = {"max": wire.DEFAULT_PULL, "wait_ms": 0, "mode": "shared", "start": "earliest"}
    pull = {**defaults, "min": 1, "linger_ms": 0, **doc}
    pull["min"] = min(pull["min"], pull["max"])  # a larger min asks for a full batch
    return pull


def _seqs(doc: Any, where: str) -> bool:
    if not isinstance(doc, list) or not 1 <= len(doc) <= wire.MAX_SEQS:
        return False
    for index, seq in enumerate(doc):
        if not _integer(seq, 0, wire.MAX_SEQ):
            raise invalid(where, f"{where}[{index}]", "a seq is an integer >= 0")
    return True


_PULL["ack"] = (False, _optional(_seqs))  # the acks a pull carries
_PULL["min"] = (False, lambda v, w: _integer(v, 1, wire.MAX_PULL))
_PULL["linger_ms"] = (False, lambda v, w: _integer(v, 0, wire.MAX_WAIT_MS))


def _partition(value: Any, where: str) -> bool:
    return _integer(value, 0, wire.MAX_PARTITION_NUMBER)


def check_ack(doc: Any, *, nack: bool = False) -> dict[str, Any]:
    fields = {**_ADDRESS, "seqs": (True, _seqs), "partition": (False, _optional(_partition))}
    if nack:
        fields["delay_ms"] = (False, _optional(lambda v, w: _integer(v, 0, wire.MAX_NACK_DELAY_MS)))
        fields["error"] = (False, _optional(lambda v, w: _text(v, high=wire.MAX_ERROR_TEXT)))
    checked = body_object(doc)
    _object(checked, fields)
    return checked


def check_redrive(doc: Any) -> list[int] | None:
    """The seqs to redrive, or None for all of them."""
    fields: dict[str, tuple[bool, Check]] = {
        "seqs": (False, _optional(_seqs)),
        "all": (False, _optional(lambda v, w: type(v) is bool)),
        "partition": (False, _optional(_partition)),
    }
    _object(body_object(doc), fields)
    seqs, everything = doc.get("seqs"), doc.get("all")
    if (seqs is None) == (everything is not True):
        raise Rejected(400, "invalid_redrive", 'give either "seqs" or "all": true', "seqs")
    return None if seqs is None else list(seqs)


def check_declare(doc: Any) -> tuple[int, wire.OnDead]:
    """The partitions and ``on_dead`` of a ``PUT /v1/subjects/{subject}`` declaration."""
    fields: dict[str, tuple[bool, Check]] = {
        "ordered": (True, lambda v, w: v is True),
        "partitions": (False, lambda v, w: _integer(v, 1, wire.MAX_PARTITIONS)),
        "on_dead": (False, lambda v, w: v in ON_DEAD),
    }
    _object(body_object(doc), fields)
    on_dead: wire.OnDead = doc.get("on_dead", "skip")
    return doc.get("partitions", 1), on_dead


def check_split(doc: Any) -> tuple[int, int]:
    """The partition and ``at`` of a ``POST .../partitions/split``."""
    fields: dict[str, tuple[bool, Check]] = {
        "partition": (True, _partition),
        "at": (True, lambda v, w: _integer(v, 1, wire.LOGIC_PARTITIONS - 1)),
    }
    _object(body_object(doc), fields)
    return doc["partition"], doc["at"]


def check_merge(doc: Any) -> list[int]:
    """The two partitions of a ``POST .../partitions/merge``."""
    fields: dict[str, tuple[bool, Check]] = {
        "partitions": (
            True,
            lambda v, w: type(v) is list and len(v) == 2 and all(_partition(p, w) for p in v),
        ),
    }
    _object(body_object(doc), fields)
    partitions: list[int] = doc["partitions"]
    return partitions


def check_move(doc: Any) -> int:
    """The partition of a ``POST .../partitions/move``."""
    _object(body_object(doc), {"partition": (True, _partition)})
    partition: int = doc["partition"]
    return partition


def check_path_name(value: str, field: str) -> str:
    if not wire.valid_name(value):
        raise invalid(field, field, f"{field} does not match the naming rules")
    return value


def int_param(
    params: Mapping[str, str], name: str, *, default: int | None, low: int, high: int
) -> int | None:
    raw = params.get(name)
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19 or not low <= int(raw) <= high:
        raise invalid(name, name, f"{name} must be an integer in [{low}, {high}]")
    return int(raw)
