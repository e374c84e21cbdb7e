"""The request rules of API v1: each request body's fields, in order, with their bounds.

One source for both checkers. The broker's request models (``qmq_broker.http.schemas``,
pydantic, and ``qmq_broker.http.bodies``, msgspec, kept in those forms for speed and for the
OpenAPI document) take their bounds, patterns, choices and defaults from the tables here;
``qmq_outbox.testing`` checks decoded JSON against the same tables with ``Request.check``.
``tests/unit/test_rules.py`` proves the models state exactly these tables.

A refusal is ``Refused``: the first offending field in field order, then unknown fields, with
the broker's codes (``missing_field``, ``unknown_field``, ``invalid_<field>``) and field paths
(``messages[3].subject``). Pure: no I/O and no third-party imports.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol

from qmq_wire import (
    BODY_ENCODINGS,
    CONSUMER_ID_PATTERN,
    DEFAULT_KEYS_IN_FLIGHT,
    DEFAULT_PULL,
    MAX_DEAD_PAGE,
    MAX_ERROR_TEXT,
    MAX_HEADER_NAME,
    MAX_HEADER_VALUE,
    MAX_HEADERS,
    MAX_KEY,
    MAX_KEYS_IN_FLIGHT,
    MAX_NACK_DELAY_MS,
    MAX_PARTITION_NUMBER,
    MAX_PRODUCE_BATCH,
    MAX_PRODUCER,
    MAX_PULL,
    MAX_SEQ,
    MAX_SEQS,
    MAX_TAGS,
    MAX_TIME_US,
    MAX_WAIT_MS,
    MESSAGE_ID_PATTERN,
    MIN_TIME_US,
    PULL_MODES,
    START_POSITIONS,
    TAG_PATTERN,
    error_status,
    valid_name,
)
from qmq_wire.ordered import LOGIC_PARTITIONS, MAX_PARTITIONS, ON_DEAD

BASE64_PATTERN: Final = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
"""Standard base64 with its padding: what ``body_encoding: "base64"`` bodies must be."""
EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
"""Where microseconds since the epoch count from (the records' and the wire's times)."""
_MICROSECOND: Final = timedelta(microseconds=1)


class Refused(Exception):
    """A request the broker refuses: its error code (the status follows), a message and the
    offending field."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    @property
    def status(self) -> int:
        return error_status(self.code)


def invalid(name: str, where: str, message: str) -> Refused:
    """``invalid_<name>`` for the field ``name`` at path ``where``."""
    return Refused(f"invalid_{name}", f"{where}: {message}", where)


class Rule(Protocol):
    """What one field's value must be; ``accepts`` may raise ``Refused`` to name a part."""

    def accepts(self, value: Any, name: str, where: str) -> bool: ...


# --- value rules ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Integer:
    """A JSON integer in ``[low, high]``."""

    low: int
    high: int

    def accepts(self, value: Any, name: str, where: str) -> bool:
        return type(value) is int and self.low <= value <= self.high


@dataclasses.dataclass(frozen=True, slots=True)
class Text:
    """A string of ``low`` to ``high`` characters, matching ``pattern`` if one is given."""

    low: int = 0
    high: int | None = None
    pattern: str | None = None

    def accepts(self, value: Any, name: str, where: str) -> bool:
        if type(value) is not str:
            return False
        if self.pattern is not None:
            return re.fullmatch(self.pattern, value) is not None
        return len(value) >= self.low and (self.high is None or len(value) <= self.high)


@dataclasses.dataclass(frozen=True, slots=True)
class Name:
    """A subject or group name (``qmq_wire.NAME_PATTERN``)."""

    def accepts(self, value: Any, name: str, where: str) -> bool:
        return type(value) is str and valid_name(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """One of ``values``."""

    values: tuple[Any, ...]

    def accepts(self, value: Any, name: str, where: str) -> bool:
        return any(type(value) is type(v) and value == v for v in self.values)


@dataclasses.dataclass(frozen=True, slots=True)
class Timestamp:
    """RFC 3339 text with an offset, within ``MIN_TIME``..``MAX_TIME`` in UTC."""

    def accepts(self, value: Any, name: str, where: str) -> bool:
        parsed = parse_timestamp(value)
        return parsed is not None and MIN_TIME_US <= micros(parsed) <= MAX_TIME_US


@dataclasses.dataclass(frozen=True, slots=True)
class PositionRule:
    """Where a group reads from: ``"earliest"``, ``"latest"``, ``{"seq": n}`` or
    ``{"time": RFC 3339}`` (``Position.of``)."""

    def accepts(self, value: Any, name: str, where: str) -> bool:
        return Position.of(value) is not None


@dataclasses.dataclass(frozen=True, slots=True)
class Items:
    """A list of ``low`` to ``high`` items; with ``each``, a bad item is named by its index;
    with ``unique``, a list that holds an item twice is refused (named as a whole)."""

    item: Rule
    low: int
    high: int
    each: bool = True
    unique: bool = False

    def accepts(self, value: Any, name: str, where: str) -> bool:
        if not isinstance(value, list) or not self.low <= len(value) <= self.high:
            return False
        for index, item in enumerate(value):
            if not self.item.accepts(item, name, f"{where}[{index}]"):
                if not self.each:
                    return False
                raise invalid(name, f"{where}[{index}]", "invalid item")
        if self.unique and len(set(value)) != len(value):
            raise invalid(name, where, DUPLICATE_ITEMS)
        return True


DUPLICATE_ITEMS: Final = "items must be unique"


@dataclasses.dataclass(frozen=True, slots=True)
class Headers:
    """A JSON object of at most ``MAX_HEADERS`` string headers."""

    key: Text
    value: Text
    most: int

    def accepts(self, value: Any, name: str, where: str) -> bool:
        if not isinstance(value, dict):
            return False
        for key, text in value.items():
            if not self.key.accepts(key, name, where) or not self.value.accepts(text, name, where):
                raise invalid(name, f"{where}.{key}", "invalid header")
        if len(value) > self.most:
            raise invalid(name, where, f"at most {self.most} headers")
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class Object:
    """A JSON object checked as ``request``, its fields' paths under ``where``: an item rule
    of ``Items`` that names the offending field itself."""

    request: Request

    def accepts(self, value: Any, name: str, where: str) -> bool:
        if not isinstance(value, dict):
            raise invalid(name, where, "Input should be an object")
        self.request.check(value, prefix=f"{where}.")
        return True


# --- fields and requests ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """A field of a request body: required, or optional with a default (``nullable``: null
    is accepted too, and means the default)."""

    name: str
    rule: Rule
    required: bool = False
    default: Any = None
    nullable: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """A request body's fields, in the order they are checked."""

    fields: tuple[Field, ...]

    def __getitem__(self, name: str) -> Field:
        for field in self.fields:
            if field.name == name:
                return field
        raise KeyError(name)

    def check(self, doc: Any, prefix: str = "") -> dict[str, Any]:
        """``doc`` checked (``Refused`` at the first broken rule), as it came."""
        if not isinstance(doc, dict):
            raise Refused("invalid_body", "request body must be a JSON object")
        for field in self.fields:
            where = f"{prefix}{field.name}"
            if field.name not in doc:
                if field.required:
                    raise Refused("missing_field", f"{where}: Field required", where)
                continue
            value = doc[field.name]
            if value is None and field.nullable:
                continue
            if not field.rule.accepts(value, field.name, where):
                raise invalid(field.name, where, "invalid value")
        names = {field.name for field in self.fields}
        for name in doc:
            if name not in names:
                where = f"{prefix}{name}"
                raise Refused("unknown_field", f"{where}: Extra inputs are not permitted", where)
        return doc

    def with_defaults(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """A checked ``doc`` with every optional field it left out at its default."""
        filled = {f.name: f.default for f in self.fields if not f.required}
        filled.update(doc)
        return filled


# --- the bounds -------------------------------------------------------------------------------

SEQ: Final = Integer(0, MAX_SEQ)
SEQS: Final = Items(SEQ, 1, MAX_SEQS)
PARTITION: Final = Integer(0, MAX_PARTITION_NUMBER)
"""A partition number a request may name (numbers grow with route changes)."""
PULL_MAX: Final = Integer(1, MAX_PULL)
KEYS_IN_FLIGHT: Final = Integer(1, MAX_KEYS_IN_FLIGHT)
WAIT_MS: Final = Integer(0, MAX_WAIT_MS)
NACK_DELAY_MS: Final = Integer(0, MAX_NACK_DELAY_MS)
ERROR_TEXT: Final = Text(high=MAX_ERROR_TEXT)
MESSAGE_ID: Final = Text(pattern=MESSAGE_ID_PATTERN)
CONSUMER_ID: Final = Text(pattern=CONSUMER_ID_PATTERN)
KEY: Final = Text(high=MAX_KEY)
HEADER_NAME: Final = Text(low=1, high=MAX_HEADER_NAME)
HEADER_VALUE: Final = Text(high=MAX_HEADER_VALUE)
PRODUCER: Final = Text(low=1, high=MAX_PRODUCER)
HEADERS: Final = Headers(HEADER_NAME, HEADER_VALUE, MAX_HEADERS)
DECLARED_PARTITIONS: Final = Integer(1, MAX_PARTITIONS)
DEAD_PAGE: Final = Integer(1, MAX_DEAD_PAGE)
"""The ``limit`` of a page of dead letters."""
TAG: Final = Text(pattern=TAG_PATTERN)
TAGS: Final = Items(TAG, 0, MAX_TAGS, unique=True)
"""A message's tags: at most ``MAX_TAGS`` distinct tags (``TAG_PATTERN``)."""
TAG_FILTER: Final = Items(TAG, 1, MAX_TAGS, unique=True)
"""A group's filter on pull: messages with any of these tags (``tags_match``)."""
SPLIT_AT: Final = Integer(1, LOGIC_PARTITIONS - 1)
"""The first logic partition of a split's second half (inside the range)."""

# --- the requests -----------------------------------------------------------------------------

ENVELOPE: Final = Request(
    (
        Field("id", MESSAGE_ID, required=True),
        Field("subject", Name(), required=True),
        Field("key", KEY, nullable=True),
        Field("headers", HEADERS, default={}),
        Field("body", Text(), required=True),
        Field("body_encoding", Choice(BODY_ENCODINGS), default=BODY_ENCODINGS[0]),
        Field("producer", PRODUCER, nullable=True),
        Field("created_at", Timestamp(), nullable=True),
        Field("deliver_at", Timestamp(), nullable=True),
        Field("tags", TAGS, default=[]),
    )
)
"""One message of ``POST /v1/messages``."""
MESSAGES: Final = Items(Object(ENVELOPE), 1, MAX_PRODUCE_BATCH)
PRODUCE: Final = Request((Field("messages", MESSAGES, required=True),))
_ADDRESS: Final = (
    Field("subject", Name(), required=True),
    Field("group", Name(), required=True),
    Field("consumer", CONSUMER_ID, required=True),
)
POSITION: Final = PositionRule()
PULL: Final = Request(
    (
        *_ADDRESS,
        Field("max", PULL_MAX, default=DEFAULT_PULL),
        Field("wait_ms", WAIT_MS, default=0),
        Field("mode", Choice(PULL_MODES), default=PULL_MODES[0]),
        Field("start", POSITION, default=START_POSITIONS[0]),
        Field("ack", SEQS, nullable=True),
        Field("min", PULL_MAX, default=1),
        Field("linger_ms", WAIT_MS, default=0),
        Field("max_keys", KEYS_IN_FLIGHT, default=DEFAULT_KEYS_IN_FLIGHT),
        Field("tags", TAG_FILTER, nullable=True),
    )
)
"""``POST /v1/pull``: ``min`` above ``max`` asks for a full batch; ``max_keys`` (ordered
mode) bounds the keys of each partition with a message in flight (1: one batch at a time)."""
ACK: Final = Request(
    (*_ADDRESS, Field("seqs", SEQS, required=True), Field("partition", PARTITION, nullable=True))
)
NACK: Final = Request(
    (
        *ACK.fields,
        Field("delay_ms", NACK_DELAY_MS, nullable=True),
        Field("error", ERROR_TEXT, nullable=True),
    )
)
REDRIVE: Final = Request(
    (
        Field("seqs", SEQS, nullable=True),
        Field("all", Choice((True, False)), nullable=True),
        Field("partition", PARTITION, nullable=True),
    )
)
"""``POST .../dead/redrive``: ``seqs``, or ``all: true`` (``redrive_seqs``)."""
RESET: Final = Request(
    (
        Field("to", POSITION, required=True),
        Field("force", Choice((True, False)), default=False),
        Field("partition", PARTITION, nullable=True),
    )
)
"""``POST .../groups/{group}/reset``: ``force`` drops leases out; ``partition`` names one
partition of an ordered subject (required there with ``{"seq": n}``)."""
DECLARE: Final = Request(
    (
        Field("ordered", Choice((True,)), required=True),
        Field("partitions", DECLARED_PARTITIONS, default=1),
        Field("on_dead", Choice(ON_DEAD), default=ON_DEAD[0]),
    )
)
"""``PUT /v1/subjects/{subject}``: only ordered subjects are declared."""
SPLIT: Final = Request(
    (Field("partition", PARTITION, required=True), Field("at", SPLIT_AT, required=True))
)
MERGED_PARTITIONS: Final = Items(PARTITION, 2, 2, each=False)
"""Two partitions with adjacent ranges."""
MERGE: Final = Request((Field("partitions", MERGED_PARTITIONS, required=True),))
MOVE: Final = Request((Field("partition", PARTITION, required=True),))


def tags_match(tags: Iterable[str], wanted: Collection[str] | None) -> bool:
    """Whether a message with ``tags`` passes a group's filter ``wanted`` (any of them; no
    filter, None or empty, passes everything). Deterministic: replay decides the same."""
    return not wanted or any(tag in wanted for tag in tags)


def redrive_seqs(doc: Mapping[str, Any]) -> list[int] | None:
    """The seqs a checked redrive names, or None for all dead letters; one or the other."""
    seqs, everything = doc.get("seqs"), doc.get("all")
    if (seqs is None) == (everything is not True):
        raise Refused("invalid_redrive", 'give either "seqs" or "all": true', "seqs")
    return None if seqs is None else list(seqs)


def check_name(value: str, field: str) -> str:
    """A subject or group named in a path; ``invalid_<field>`` if it breaks the name rules."""
    if not valid_name(value):
        raise invalid(field, field, f"{field} does not match the naming rules")
    return value


def query_integer(
    params: Mapping[str, str], name: str, rule: Integer, *, default: int | None
) -> int | None:
    """An integer query parameter in ``rule``'s range (digits only), or ``default``."""
    raw = params.get(name)
    if raw is None:
        return default
    digits = raw.isascii() and raw.isdigit() and len(raw) <= 19
    if not digits or not rule.accepts(int(raw), name, name):
        raise invalid(name, name, f"{name} must be an integer in [{rule.low}, {rule.high}]")
    return int(raw)


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
    """Microseconds since the epoch, exact (never overflows, unlike converting to UTC)."""
    return (value - EPOCH) // _MICROSECOND


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Position:
    """A checked position: ``kind`` and, for ``seq`` and ``time``, the seq or the time in
    microseconds since the epoch."""

    kind: str  # "earliest" | "latest" | "seq" | "time"
    value: int = 0

    @classmethod
    def of(cls, doc: Any) -> Position | None:
        """The position a JSON value states, or None when it is not one."""
        if type(doc) is str:
            return cls(kind=doc) if doc in START_POSITIONS else None
        if not isinstance(doc, dict) or len(doc) != 1:
            return None
        ((kind, value),) = doc.items()
        if kind == "seq" and SEQ.accepts(value, kind, kind):
            return cls(kind="seq", value=value)
        if kind == "time" and Timestamp().accepts(value, kind, kind):
            parsed = parse_timestamp(value)
            assert parsed is not None
            return cls(kind="time", value=micros(parsed))
        return None

    def describe(self) -> str:
        """For messages and logs: ``earliest``, ``seq 12``, ``time 2026-...Z``."""
        if self.kind == "seq":
            return f"seq {self.value}"
        if self.kind == "time":
            moment = EPOCH + self.value * _MICROSECOND
            return f"time {moment.isoformat().replace('+00:00', 'Z')}"
        return self.kind
