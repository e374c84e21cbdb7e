"""Request models of API v1 (pydantic, strict): the tables of ``qmq_wire.rules`` as models.

Every bound, pattern, choice and default is read from those tables (the in-memory broker
checks with the same ones; ``tests/unit/test_rules.py`` proves the models state them).

They are the OpenAPI document's request schemas too (``qmq_broker.http.openapi``), so a rule the
broker checks elsewhere (a base64 body, ``seqs`` or ``all`` in a redrive, the timestamp
range) is stated here as JSON Schema beside the field it governs: a client that follows the
document is never refused with a 400.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
)

import qmq_wire as wire
from qmq_wire import rules


def _json_integer(value: object) -> object:
    """JSON Schema counts ``104.0`` as an integer, so the broker does too (``104.5`` stays
    invalid, and so do ``true`` and ``"104"``)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_AS_JSON_INTEGER = BeforeValidator(_json_integer)


def _between(rule: rules.Integer, description: str | None = None) -> Any:
    """An integer field's bounds, from its rule."""
    return Field(ge=rule.low, le=rule.high, description=description)


def _text(rule: rules.Text) -> StringConstraints:
    """A text field's length or pattern, from its rule."""
    if rule.pattern is not None:
        return StringConstraints(pattern=rule.pattern)
    return StringConstraints(min_length=rule.low or None, max_length=rule.high)


def _items(rule: rules.Items, description: str | None = None) -> Any:
    """A list field's length, from its rule; distinct items are stated for the document
    (``_unique`` checks them)."""
    unique: dict[str, Any] | None = {"uniqueItems": True} if rule.unique else None
    return Field(
        min_length=rule.low, max_length=rule.high, json_schema_extra=unique, description=description
    )


def _default(request: rules.Request, name: str) -> Any:
    return request[name].default


Subject = Annotated[str, StringConstraints(pattern=wire.NAME_PATTERN)]
GroupName = Annotated[str, StringConstraints(pattern=wire.NAME_PATTERN)]
MessageId = Annotated[str, _text(rules.MESSAGE_ID)]
ConsumerId = Annotated[str, _text(rules.CONSUMER_ID)]
HeaderName = Annotated[str, _text(rules.HEADER_NAME)]
HeaderValue = Annotated[str, _text(rules.HEADER_VALUE)]
Seq = Annotated[int, _between(rules.SEQ), _AS_JSON_INTEGER]
Seqs = Annotated[list[Seq], _items(rules.SEQS)]
Partition = Annotated[
    int, _between(rules.PARTITION, "an ordered subject's partition"), _AS_JSON_INTEGER
]


def _unique(values: list[str]) -> list[str]:
    if len(set(values)) != len(values):
        raise ValueError(rules.DUPLICATE_ITEMS)
    return values


_TAG = Annotated[str, _text(rules.TAG)]
Tags = Annotated[
    list[_TAG],
    _items(rules.TAGS, "the message's tags, distinct; a group's tag filter matches on them"),
    AfterValidator(_unique),
]
TagFilter = Annotated[
    list[_TAG],
    _items(rules.TAG_FILTER, "a tag filter: messages with any of these tags"),
    AfterValidator(_unique),
]

BASE64_PATTERN = rules.BASE64_PATTERN
_OUT_OF_RANGE = r"^(?:0001-01-01T[^+]*\+(?!00:00)|9999-12-31T.*-(?!00:00)\d\d:\d\d$)"
"""RFC 3339 times on the range's first day with a positive offset or its last day with a
negative one: some of them fall outside ``wire.MIN_TIME``..``wire.MAX_TIME`` in UTC, so the
document refuses the lot (UTC or the other sign is always fine there)."""

TIMESTAMP_SCHEMA: dict[str, Any] = {
    "type": "string",
    "format": "date-time",
    "not": {"pattern": _OUT_OF_RANGE},
    "description": f"RFC 3339 with an offset, between {wire.MIN_TIME} and {wire.MAX_TIME} in UTC",
}
Timestamp = Annotated[AwareDatetime, WithJsonSchema(TIMESTAMP_SCHEMA)]


def _position(value: Any) -> Any:
    """``value`` as ``qmq_wire.rules.Position.of`` reads it, or ``ValueError``. As for the
    other fields, a seq may be ``104.0`` and a time is read by pydantic's parser (then
    given as UTC text: the form the rule reads)."""
    if rules.Position.of(value) is not None:
        return value
    if isinstance(value, dict) and len(value) == 1:
        ((kind, inner),) = value.items()
        if kind == "seq" and isinstance(inner, float) and inner.is_integer():
            value = {"seq": int(inner)}
        elif kind == "time" and isinstance(inner, str):
            value = {"time": _utc_text(inner)}
    if rules.Position.of(value) is None:
        raise ValueError(
            'a position is "earliest", "latest", {"seq": n} or {"time": RFC 3339 text}'
        )
    return value


def _utc_text(text: str) -> str:
    """An RFC 3339 time in range, as UTC text; the text itself when it is not one (the
    caller then refuses it)."""
    try:
        moment = _TIMESTAMP.validate_json(orjson.dumps(text))
    except ValidationError:
        return text
    us = rules.micros(moment)
    if not wire.MIN_TIME_US <= us <= wire.MAX_TIME_US:
        return text
    return (rules.EPOCH + timedelta(microseconds=us)).isoformat().replace("+00:00", "Z")


POSITION_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"enum": list(wire.START_POSITIONS)},
        {
            "type": "object",
            "properties": {
                "seq": {"type": "integer", "minimum": rules.SEQ.low, "maximum": rules.SEQ.high}
            },
            "required": ["seq"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"time": TIMESTAMP_SCHEMA},
            "required": ["time"],
            "additionalProperties": False,
        },
    ],
    "description": (
        "earliest, latest, the message with this seq, or the first message stored at or "
        "after this time"
    ),
}
_TIMESTAMP: TypeAdapter[datetime] = TypeAdapter(Timestamp, config=ConfigDict(strict=True))
Position = Annotated[Any, AfterValidator(_position), WithJsonSchema(POSITION_SCHEMA)]
"""A group's position: the same rule as ``qmq_wire.rules.POSITION``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _base64_body(schema: dict[str, Any]) -> None:
    schema["if"] = {
        "properties": {"body_encoding": {"const": "base64"}},
        "required": ["body_encoding"],
    }
    schema["then"] = {"properties": {"body": {"pattern": BASE64_PATTERN}}}


class Envelope(_Strict):
    model_config = ConfigDict(json_schema_extra=_base64_body)

    id: MessageId
    subject: Subject
    key: Annotated[str, _text(rules.KEY)] | None = None
    headers: Annotated[dict[HeaderName, HeaderValue], Field(max_length=rules.HEADERS.most)] = Field(
        default_factory=dict
    )
    body: str = Field(
        description=(
            f"UTF-8 text, or base64 with body_encoding base64; at most {wire.MAX_BODY_BYTES} "
            "bytes once decoded by default (--max-body-size; 413 beyond)"
        )
    )
    body_encoding: wire.BodyEncoding = _default(rules.ENVELOPE, "body_encoding")
    producer: Annotated[str, _text(rules.PRODUCER)] | None = None
    created_at: Timestamp | None = None
    deliver_at: Timestamp | None = Field(
        default=None,
        description=(
            "delayed delivery; null or a past time delivers now, and at most --max-delay "
            "(2 years by default) ahead (400 delay_too_long beyond)"
        ),
    )
    tags: Tags = Field(default_factory=list)


class ProduceRequest(_Strict):
    messages: Annotated[list[Envelope], _items(rules.MESSAGES)]


class PullRequest(_Strict):
    subject: Subject
    group: GroupName
    consumer: ConsumerId
    max: Annotated[int, _between(rules.PULL_MAX), _AS_JSON_INTEGER] = _default(rules.PULL, "max")
    wait_ms: Annotated[int, _between(rules.WAIT_MS), _AS_JSON_INTEGER] = _default(
        rules.PULL, "wait_ms"
    )
    mode: wire.PullMode = Field(
        default=_default(rules.PULL, "mode"),
        description="ordered: the only mode of an ordered subject",
    )
    start: Position = Field(
        default=_default(rules.PULL, "start"),
        description="where a group (a broadcast consumer) new to the subject starts",
    )
    ack: Annotated[
        Seqs | None,
        Field(
            description=(
                "Seqs this consumer acks with the pull, as POST /v1/ack would "
                "(not in ordered mode: acks name their partition there)."
            )
        ),
    ] = None
    min: Annotated[
        int,
        _between(
            rules.PULL_MAX,
            "During linger_ms, answer only with at least this many (above max: max).",
        ),
        _AS_JSON_INTEGER,
    ] = _default(rules.PULL, "min")
    linger_ms: Annotated[
        int,
        _between(rules.WAIT_MS, "How long the pull may wait for min messages (within wait_ms)."),
        _AS_JSON_INTEGER,
    ] = _default(rules.PULL, "linger_ms")
    max_keys: Annotated[
        int,
        _between(
            rules.KEYS_IN_FLIGHT,
            "Ordered mode: keys of a partition with a message in flight at once (1: the "
            "partition's next batch only once the previous one is acked).",
        ),
        _AS_JSON_INTEGER,
    ] = _default(rules.PULL, "max_keys")
    tags: Annotated[
        TagFilter | None,
        Field(
            description=(
                "The group's tag filter (any of these), fixed by its first pull: a different "
                "one is 409 tags_conflict until the group is reset. Not in ordered mode."
            )
        ),
    ] = None


class AckRequest(_Strict):
    subject: Subject
    group: GroupName
    consumer: ConsumerId
    seqs: Seqs
    partition: Partition | None = Field(
        default=None, description="required for an ordered subject, refused for a plain one"
    )


class NackRequest(AckRequest):
    delay_ms: Annotated[int, _between(rules.NACK_DELAY_MS), _AS_JSON_INTEGER] | None = None
    error: Annotated[str, _text(rules.ERROR_TEXT)] | None = None


def _seqs_or_all(schema: dict[str, Any]) -> None:
    # The broker redrives the seqs given or, with "all": true, every dead letter; not both.
    schema["anyOf"] = [
        {
            "required": ["seqs"],
            "properties": {"seqs": {"type": "array"}, "all": {"enum": [False, None]}},
        },
        {"required": ["all"], "properties": {"all": {"const": True}, "seqs": {"type": "null"}}},
    ]


class RedriveRequest(_Strict):
    model_config = ConfigDict(json_schema_extra=_seqs_or_all)

    seqs: Seqs | None = None
    all: bool | None = None
    partition: Partition | None = Field(
        default=None, description="required for an ordered subject, refused for a plain one"
    )


class ResetRequest(_Strict):
    to: Position
    force: bool = Field(
        default=_default(rules.RESET, "force"),
        description="drop the messages leased out (their acks become unknown) instead of a 409",
    )
    partition: Partition | None = Field(
        default=None,
        description="one partition of an ordered subject (required there with a seq)",
    )


class DeclareRequest(_Strict):
    ordered: Literal[True] = Field(description="only ordered subjects are declared")
    partitions: Annotated[
        int, _between(rules.DECLARED_PARTITIONS, "physical partitions"), _AS_JSON_INTEGER
    ] = _default(rules.DECLARE, "partitions")
    on_dead: wire.OnDead = Field(
        default=_default(rules.DECLARE, "on_dead"),
        description="block: a partition waits while it has dead letters, until redriven",
    )


class SplitRequest(_Strict):
    partition: Partition
    at: Annotated[
        int,
        _between(rules.SPLIT_AT, "the first logic partition of the second half (inside the range)"),
        _AS_JSON_INTEGER,
    ]


class MergeRequest(_Strict):
    partitions: Annotated[
        list[Partition],
        Field(
            min_length=rules.MERGED_PARTITIONS.low,
            max_length=rules.MERGED_PARTITIONS.high,
            description="two partitions with adjacent ranges",
        ),
    ]


class MoveRequest(_Strict):
    partition: Partition


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    Envelope,
    ProduceRequest,
    PullRequest,
    AckRequest,
    NackRequest,
    RedriveRequest,
    ResetRequest,
    DeclareRequest,
    SplitRequest,
    MergeRequest,
    MoveRequest,
)
"""Every request model (error codes name their fields; the OpenAPI document lists them)."""
