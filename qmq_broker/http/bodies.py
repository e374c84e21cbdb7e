"""Bodies of the busy routes (produce, pull, ack, nack) decoded by msgspec, by the models' rules.

pydantic's ``validate_json`` and a model object per envelope cost more than storing the
message. The msgspec structs here state the same tables of ``qmq_wire.rules`` as
``qmq_broker.http.schemas`` (bounds, patterns, choices, defaults; ``tests/unit/test_rules.py``)
and decode a body in one pass in C; the id and subject rules stay hand-written in
``Envelope.__post_init__`` for speed, from the same constants. The pydantic models stay the
reference: they make the OpenAPI document, and a body msgspec refuses is handed to them, so
its answer is their first error, exactly as when they alone validated. msgspec reads a few
valid bodies more strictly (``104.0`` for an integer, a key given twice whose first value is
invalid); the reference accepts those and its canonical dump of them is decoded instead.
Should msgspec still refuse a body the reference accepts, that is a bug: logged, and a 500.
``tests/unit/test_bodies.py`` feeds one corpus of good and bad bodies through both.

Timestamps arrive as microseconds since the epoch, exact: the common RFC 3339 form
``YYYY-MM-DDTHH:MM:SS[.f{1,6}]Z`` is read by ``datetime.fromisoformat``; any other form (an
offset, lower case, a comma, more digits) by the reference's own parser, so the same texts
are accepted with the same instants. The range check stays with the route (its error is
``invalid_<field>`` after auth, as before).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Annotated, Any, Final, TypeVar

import msgspec
import orjson
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

import qmq_wire as wire
from qmq_broker.errors import RequestError
from qmq_broker.http import schemas
from qmq_broker.http.errors import from_validation
from qmq_wire import rules

logger = logging.getLogger(__name__)


def _whole(pattern: str) -> str:
    """A ``^...$`` pattern for msgspec, which searches with ``re``: there ``$`` also matches
    before a final newline, where pydantic's (Rust) regex matches only at the very end."""
    assert pattern.startswith("^"), pattern
    assert pattern.endswith("$"), pattern
    return pattern[:-1] + r"\Z"


class TimestampUs(int):
    """An RFC 3339 timestamp with an offset, as microseconds since the Unix epoch."""

    __slots__ = ()


_MICROSECOND: Final = timedelta(microseconds=1)
_REFERENCE_TIMESTAMP: Final = TypeAdapter(schemas.Timestamp, config=ConfigDict(strict=True))


def timestamp_us(text: str) -> TimestampUs:
    """The instant of an RFC 3339 text as the reference reads it; ``ValueError`` if it does not.

    Subtracting aware datetimes never overflows, even where converting to UTC would
    (``9999-12-31T23:59:59-23:59``); the route's range check then refuses what it must.
    """
    size = len(text)
    shape = text[4:20:3]  # the characters at 4, 7, 10, 13, 16 and 19
    if (
        (shape == "--T::Z" and size == 20)
        or (shape == "--T::." and 21 < size < 28 and text[-1] == "Z")
    ) and text.isascii():
        try:
            return TimestampUs((datetime.fromisoformat(text) - rules.EPOCH) // _MICROSECOND)
        except ValueError:
            pass  # e.g. a 30th of February: the reference says what is wrong
    value = _REFERENCE_TIMESTAMP.validate_json(orjson.dumps(text))  # ValidationError: ValueError
    return TimestampUs((value - rules.EPOCH) // _MICROSECOND)


def _decode_hook(kind: type[Any], value: Any) -> Any:
    if kind is TimestampUs:
        if type(value) is not str:
            raise TypeError("a timestamp is a string")
        return timestamp_us(value)
    raise NotImplementedError(kind)


def _between(rule: rules.Integer) -> msgspec.Meta:
    return msgspec.Meta(ge=rule.low, le=rule.high)


def _text(rule: rules.Text) -> msgspec.Meta:
    if rule.pattern is not None:
        return msgspec.Meta(pattern=_whole(rule.pattern))
    return msgspec.Meta(min_length=rule.low or None, max_length=rule.high)


def _items(rule: rules.Items) -> msgspec.Meta:
    """A list's length, from its rule; distinct items are stated for the document (checked by
    ``_distinct``)."""
    unique = {"uniqueItems": True} if rule.unique else None
    return msgspec.Meta(min_length=rule.low, max_length=rule.high, extra_json_schema=unique)


def _default(request: rules.Request, name: str) -> Any:
    return request[name].default


Name = Annotated[str, msgspec.Meta(pattern=_whole(wire.NAME_PATTERN))]
ConsumerId = Annotated[str, _text(rules.CONSUMER_ID)]
Key = Annotated[str, _text(rules.KEY)]
HeaderName = Annotated[str, _text(rules.HEADER_NAME)]
HeaderValue = Annotated[str, _text(rules.HEADER_VALUE)]
Headers = Annotated[dict[HeaderName, HeaderValue], msgspec.Meta(max_length=rules.HEADERS.most)]
Producer = Annotated[str, _text(rules.PRODUCER)]
Seq = Annotated[int, _between(rules.SEQ)]
Seqs = Annotated[list[Seq], _items(rules.SEQS)]
PullMax = Annotated[int, _between(rules.PULL_MAX)]
WaitMs = Annotated[int, _between(rules.WAIT_MS)]
KeysInFlight = Annotated[int, _between(rules.KEYS_IN_FLIGHT)]
NackDelayMs = Annotated[int, _between(rules.NACK_DELAY_MS)]
ErrorText = Annotated[str, _text(rules.ERROR_TEXT)]
Partition = Annotated[int, _between(rules.PARTITION)]
Tag = Annotated[str, _text(rules.TAG)]
Tags = Annotated[list[Tag], _items(rules.TAGS)]
TagFilter = Annotated[list[Tag], _items(rules.TAG_FILTER)]


def _distinct(tags: list[str] | None) -> None:
    """Duplicate tags, which msgspec cannot state: the reference model answers them."""
    if tags and len(set(tags)) != len(tags):
        raise ValueError(rules.DUPLICATE_ITEMS)


_VALID_SUBJECTS: set[str] = set()
"""A memo of subject names found valid (a batch mostly names one, a broker a few): a set
lookup instead of a regular expression per message, kept to a bounded size."""
_VALID_SUBJECTS_KEPT: Final = 4096
_MESSAGE_ID_RULE: Final = rf"^[\x20-\x7e]{{1,{wire.MAX_MESSAGE_ID}}}$"
"""The id rule ``Envelope.__post_init__`` checks without the pattern: the wire's must be it."""
assert rules.MESSAGE_ID.pattern == _MESSAGE_ID_RULE, rules.MESSAGE_ID.pattern


class _Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class Envelope(_Body, frozen=True, gc=False):
    """One message of a produce; ``gc=False``: it holds no containers but a dict and a list
    of strings, so it cannot be part of a reference cycle."""

    id: str  # the id and subject rules are checked by __post_init__: cheaper than a pattern
    subject: str
    body: str
    key: Key | None = None
    headers: Headers = {}
    body_encoding: wire.BodyEncoding = _default(rules.ENVELOPE, "body_encoding")
    producer: Producer | None = None
    created_at: TimestampUs | None = None
    deliver_at: TimestampUs | None = None
    tags: Tags = []

    def __post_init__(self) -> None:
        _distinct(self.tags)
        message_id = self.id
        # ^[\x20-\x7e]{1,128}$: among ASCII characters the printable ones are \x20-\x7e
        if not (
            0 < len(message_id) <= wire.MAX_MESSAGE_ID
            and message_id.isascii()
            and message_id.isprintable()
        ):
            raise ValueError("id does not match the rule")
        if self.subject not in _VALID_SUBJECTS:
            if not wire.valid_name(self.subject):
                raise ValueError("subject does not match the naming rules")
            if len(_VALID_SUBJECTS) < _VALID_SUBJECTS_KEPT:
                _VALID_SUBJECTS.add(self.subject)


class ProduceBody(_Body, frozen=True):
    messages: Annotated[list[Envelope], _items(rules.MESSAGES)]


class PullBody(_Body, frozen=True):
    subject: Name
    group: Name
    consumer: ConsumerId
    max: PullMax = _default(rules.PULL, "max")
    wait_ms: WaitMs = _default(rules.PULL, "wait_ms")
    mode: wire.PullMode = _default(rules.PULL, "mode")
    start: str | dict[str, Any] = _default(rules.PULL, "start")
    ack: Seqs | None = None
    min: PullMax = _default(rules.PULL, "min")
    linger_ms: WaitMs = _default(rules.PULL, "linger_ms")
    max_keys: KeysInFlight = _default(rules.PULL, "max_keys")
    tags: TagFilter | None = None

    def __post_init__(self) -> None:
        if self.start != "earliest" and rules.Position.of(self.start) is None:
            raise ValueError("start is not a position")  # the reference model says why
        _distinct(self.tags)

    @property
    def position(self) -> rules.Position:
        """``start``, checked."""
        found = rules.Position.of(self.start)
        assert found is not None
        return found


class AckBody(_Body, frozen=True):
    subject: Name
    group: Name
    consumer: ConsumerId
    seqs: Seqs
    partition: Partition | None = None


class NackBody(AckBody, frozen=True):
    delay_ms: NackDelayMs | None = None
    error: ErrorText | None = None


Body = TypeVar("Body", ProduceBody, PullBody, AckBody, NackBody)

REFERENCES: Final[dict[type[Any], type[BaseModel]]] = {
    ProduceBody: schemas.ProduceRequest,
    PullBody: schemas.PullRequest,
    AckBody: schemas.AckRequest,
    NackBody: schemas.NackRequest,
}
"""Each body's reference model: what it accepts, and its first error answers a refusal."""
DECODERS: Final[dict[type[Any], msgspec.json.Decoder[Any]]] = {
    body: msgspec.json.Decoder(body, dec_hook=_decode_hook) for body in REFERENCES
}
_ADAPTERS: Final[dict[type[Any], TypeAdapter[Any]]] = {
    body: TypeAdapter(model) for body, model in REFERENCES.items()
}


def decode(raw: bytes, body: type[Body]) -> Body:
    """``raw`` decoded as ``body``; ``Invalid`` with the reference model's first error if it
    refuses it."""
    decoder = DECODERS[body]
    try:
        decoded: Body = decoder.decode(raw)
        return decoded
    except (msgspec.DecodeError, ValueError):  # invalid UTF-8 in a string is a ValueError
        pass
    adapter = _ADAPTERS[body]
    try:
        accepted = adapter.validate_json(raw)
    except ValidationError as exc:
        raise from_validation(exc) from None
    try:
        decoded = decoder.decode(adapter.dump_json(accepted))
    except (msgspec.DecodeError, ValueError) as exc:
        logger.error(
            "msgspec refuses a body its reference model accepts",
            extra={"action": "broker.body_mismatch", "body": body.__name__, "error": str(exc)},
        )
        raise RequestError(code="internal", message="internal error; see the broker log") from exc
    return decoded
