"""The msgspec decoders of the busy routes accept and refuse exactly what the pydantic models
(the OpenAPI document's source) do, with the same values and the same error answers.

One corpus of good and bad bodies goes through both. For each body the outcome is either the
decoded value (timestamps as microseconds) or the error answer (code, field, message). The
fast decoder alone (no fall back to the models) must agree too, except on the few bodies it
reads more strictly, listed in ``STRICTER``: those must still come out right through
``bodies.decode``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

import qmq_wire as wire
from qmq_broker.errors import RequestError
from qmq_broker.http import bodies, schemas
from qmq_broker.http.errors import from_validation

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
US = timedelta(microseconds=1)
ENVELOPE: dict[str, Any] = {"id": "m-1", "subject": "orders", "body": "hello"}
PULL: dict[str, Any] = {"subject": "orders", "group": "g", "consumer": "c-1"}
ACK: dict[str, Any] = {**PULL, "seqs": [1, 2]}


def _plain(value: Any) -> Any:
    """A decoded value in a form both sides share: datetimes as microseconds, models and
    structs as dicts."""
    if isinstance(value, BaseModel):
        return {name: _plain(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, msgspec.Struct):
        return {name: _plain(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, datetime):
        return (value - EPOCH) // US
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return value


Outcome = tuple[str, Any]


def _reference(raw: bytes, body: type[Any]) -> Outcome:
    try:
        return "ok", _plain(TypeAdapter(bodies.REFERENCES[body]).validate_json(raw))
    except ValidationError as exc:
        error = from_validation(exc)
        return "error", (error.code, error.field, error.message)


def _ours(raw: bytes, body: type[Any]) -> Outcome:
    try:
        return "ok", _plain(bodies.decode(raw, body))
    except RequestError as error:
        return "error", (error.code, error.field, error.message)


def _fast_accepts(raw: bytes, body: type[Any]) -> bool:
    try:
        bodies.DECODERS[body].decode(raw)
    except (msgspec.DecodeError, ValueError):
        return False
    return True


_GONE = object()  # a field left out


def _produce(**changes: Any) -> bytes:
    envelope = {**ENVELOPE, **changes}
    return orjson.dumps({"messages": [{k: v for k, v in envelope.items() if v is not _GONE}]})


def _without(doc: dict[str, Any], name: str) -> bytes:
    return orjson.dumps({k: v for k, v in doc.items() if k != name})


TIMESTAMPS = [
    "2026-11-22T10:00:00Z",
    "2026-11-22T10:00:00.1Z",
    "2026-11-22T10:00:00.123456Z",
    "2026-11-22T10:00:00.1234567Z",  # the reference truncates past microseconds
    "2026-11-22T10:00:00.9999999Z",
    "2026-11-22T10:00:00.000000001Z",
    "2026-11-22t10:00:00z",
    "2026-11-22 10:00:00Z",
    "2026-11-22T10:00Z",
    "2026-11-22T10:00:00+05:30",
    "2026-11-22T10:00:00.5-05:30",
    "2026-11-22T10:00:00+0530",
    "2026-11-22T10:00:00-00:00",
    "2026-11-22T10:00:00+23:59",
    "2026-11-22T10:00:00,5Z",
    "1732000000",  # the reference reads a number of seconds in a string
    "1732000000.5",
    "2024-02-29T00:00:00Z",
    "0001-01-01T00:00:00Z",
    "9999-12-31T23:59:59.999999Z",
    "0001-01-01T00:00:00+01:00",  # the model admits it; the route refuses it (range)
    "9999-12-31T23:59:59-23:59",
    # refused
    "2026-11-22T10:00:00",
    "2026-11-22",
    "2026-02-29T00:00:00Z",
    "2026-13-01T00:00:00Z",
    "2026-11-31T00:00:00Z",
    "2026-11-22T24:00:00Z",
    "2026-11-22T23:59:60Z",
    "2026-11-22T10:60:00Z",
    "0000-01-01T00:00:00Z",
    "2026-11-22T10:00:00+05",
    "2026-11-22T10:00:00+24:00",
    "2026-11-22T10:00:00+05:30:00",
    "2026-11-22T10:00:00 Z",
    "2026-11-22T10:00:00.Z",
    "2026-11-22T10:00:00UTC",
    "2026-W47-1T10:00:00Z",
    "20261122T100000Z",
    "2026-11-22T100000.5Z",
    "+2026-11-22T10:00:00Z",
    "2026-11-22T1:00:00Z",
    "\uff12\uff10\uff12\uff16-11-22T10:00:00Z",  # full-width digits
    "2026-11-22T10:00:00.12345\uff16Z",
    "",
    "Z",
]

PRODUCE_BODIES: list[bytes] = [
    _produce(),
    _produce(id=" "),
    _produce(id="~" * wire.MAX_MESSAGE_ID),
    _produce(id="a" * (wire.MAX_MESSAGE_ID + 1)),
    _produce(id=""),
    _produce(id="a\n"),
    _produce(id="a\x7f"),
    _produce(id="a\x1f"),
    _produce(id="é"),
    _produce(id=5),
    _produce(id=None),
    _produce(id=_GONE),
    _produce(subject="a"),
    _produce(subject="a.b-c_D9"),
    _produce(subject="a" * 200),
    _produce(subject="a" * 201),
    _produce(subject="orders\n"),
    _produce(subject="_orders"),
    _produce(subject=".orders"),
    _produce(subject="or ders"),
    _produce(subject="ordérs"),
    _produce(subject=""),
    _produce(subject=None),
    _produce(subject=7),
    _produce(subject=_GONE),
    _produce(key=None),
    _produce(key=""),
    _produce(key="k" * wire.MAX_KEY),
    _produce(key="k" * (wire.MAX_KEY + 1)),
    _produce(key="😀" * wire.MAX_KEY),  # a character each, two UTF-16 units
    _produce(key="😀" * (wire.MAX_KEY + 1)),
    _produce(key=5),
    _produce(headers={}),
    _produce(headers={"a": "1", "b": ""}),
    _produce(headers={"": "v"}),
    _produce(headers={"h" * wire.MAX_HEADER_NAME: "v"}),
    _produce(headers={"h" * (wire.MAX_HEADER_NAME + 1): "v"}),
    _produce(headers={"a": "v" * wire.MAX_HEADER_VALUE}),
    _produce(headers={"a": "v" * (wire.MAX_HEADER_VALUE + 1)}),
    _produce(headers={f"h{i}": "v" for i in range(wire.MAX_HEADERS)}),
    _produce(headers={f"h{i}": "v" for i in range(wire.MAX_HEADERS + 1)}),
    _produce(headers={"a": 5}),
    _produce(headers={"a": None}),
    _produce(headers={"subject": 5}),  # a header named like a field
    _produce(headers=None),
    _produce(headers=[]),
    _produce(body=""),
    _produce(body="héllo \u2028 \x00"),
    _produce(body=5),
    _produce(body=None),
    _produce(body=_GONE),
    _produce(body="aGk=", body_encoding="base64"),
    _produce(body="not base64!", body_encoding="base64"),  # the route refuses it
    _produce(body_encoding="utf-8"),
    _produce(body_encoding="UTF-8"),
    _produce(body_encoding=None),
    _produce(body_encoding=1),
    _produce(producer=None),
    _produce(producer="p"),
    _produce(producer=""),
    _produce(producer="p" * wire.MAX_PRODUCER),
    _produce(producer="p" * (wire.MAX_PRODUCER + 1)),
    _produce(producer=False),
    *[_produce(created_at=stamp) for stamp in TIMESTAMPS],
    *[_produce(deliver_at=stamp) for stamp in TIMESTAMPS[::3]],
    _produce(created_at=None, deliver_at=None),
    _produce(created_at=1732000000),
    _produce(created_at=1732000000.5),
    _produce(created_at=True),
    _produce(created_at=["2026-11-22T10:00:00Z"]),
    _produce(deliver_at={}),
    _produce(extra=1),
    _produce(seq=1),
    orjson.dumps({"messages": [ENVELOPE] * wire.MAX_PRODUCE_BATCH}),
    orjson.dumps({"messages": [ENVELOPE] * (wire.MAX_PRODUCE_BATCH + 1)}),
    orjson.dumps({"messages": [ENVELOPE, {**ENVELOPE, "subject": "bad subject"}]}),
    orjson.dumps({"messages": [{**ENVELOPE, "id": ""}, {**ENVELOPE, "subject": "!"}]}),
    orjson.dumps({"messages": [ENVELOPE, {**ENVELOPE, "created_at": "2026-02-30T00:00:00Z"}]}),
    orjson.dumps({"messages": [ENVELOPE, 5]}),
    orjson.dumps({"messages": []}),
    orjson.dumps({"messages": None}),
    orjson.dumps({"messages": ENVELOPE}),
    orjson.dumps({"messages": [ENVELOPE], "extra": True}),
    orjson.dumps({}),
    b"[]",
    b"null",
    b'"messages"',
    b"5",
    b"",
    b" ",
    b"{",
    b'{"messages": [' + orjson.dumps(ENVELOPE) + b"]}x",
    b'  {"messages": [' + orjson.dumps(ENVELOPE) + b"]}\n",
    b'\xef\xbb\xbf{"messages": []}',
    b'{"messages": [{"id": "m", "subject": "s", "body": "\xff"}]}',
    b'{"messages": [{"id": "m", "subject": "s", "body": "a\\ud800b"}]}',
    b'{"messages": [{"id": "m", "subject": "s", "body": "\\ud83d\\ude00"}]}',
    b'{"messages": [{"id": "m", "subject": "s", "body": "a\x01"}]}',
    b'{"messages": [{"id": "m", "subject": "s", "body": "b", "body": 5}]}',
    b'{"messages": [{"id": "m", "subject": "bad!", "subject": "s", "body": "b"}]}',
    b'{"messages": [{"id": "m", "subject": "s", "body": "b", "headers": {"a": "1", "a": "2"}}]}',
    b'{"messages": [{"id": "m", "subject": "s", "body": "b", "key": NaN}]}',
]

PULL_BODIES: list[bytes] = [
    orjson.dumps(PULL),
    orjson.dumps({**PULL, "max": 1, "wait_ms": 0, "mode": "broadcast", "start": "latest"}),
    orjson.dumps({**PULL, "max": wire.MAX_PULL, "wait_ms": wire.MAX_WAIT_MS}),
    orjson.dumps({**PULL, "max": 0}),
    orjson.dumps({**PULL, "max": wire.MAX_PULL + 1}),
    orjson.dumps({**PULL, "max": 5.0}),
    orjson.dumps({**PULL, "max": -0.0}),
    orjson.dumps({**PULL, "wait_ms": -0.0}),
    orjson.dumps({**PULL, "max": 5.5}),
    orjson.dumps({**PULL, "max": "5"}),
    orjson.dumps({**PULL, "max": True}),
    orjson.dumps({**PULL, "max": None}),
    orjson.dumps({**PULL, "wait_ms": -1}),
    orjson.dumps({**PULL, "wait_ms": wire.MAX_WAIT_MS + 1}),
    orjson.dumps({**PULL, "wait_ms": 100.0}),
    orjson.dumps({**PULL, "mode": "fifo"}),
    orjson.dumps({**PULL, "mode": None}),
    orjson.dumps({**PULL, "start": "middle"}),
    orjson.dumps({**PULL, "start": {"seq": 3}}),
    orjson.dumps({**PULL, "start": {"seq": 3.0}}),
    orjson.dumps({**PULL, "start": {"seq": -1}}),
    orjson.dumps({**PULL, "start": {"seq": "3"}}),
    orjson.dumps({**PULL, "start": {"time": "2026-11-22T10:00:00Z"}}),
    orjson.dumps({**PULL, "start": {"time": "2026-11-22T10:00:00.5-05:30"}}),
    orjson.dumps({**PULL, "start": {"time": "2026-11-22T10:00:00+0530"}}),
    orjson.dumps({**PULL, "start": {"time": "2026-11-22"}}),
    orjson.dumps({**PULL, "start": {"time": "0001-01-01T00:00:00+01:00"}}),
    orjson.dumps({**PULL, "start": {"seq": 1, "time": "2026-11-22T10:00:00Z"}}),
    orjson.dumps({**PULL, "start": {"offset": 1}}),
    orjson.dumps({**PULL, "start": {}}),
    orjson.dumps({**PULL, "start": None}),
    orjson.dumps({**PULL, "consumer": "c" * 200}),
    orjson.dumps({**PULL, "consumer": "c" * 201}),
    orjson.dumps({**PULL, "consumer": "a b"}),
    orjson.dumps({**PULL, "consumer": ""}),
    orjson.dumps({**PULL, "consumer": "c\n"}),
    orjson.dumps({**PULL, "group": "g\n"}),
    orjson.dumps({**PULL, "group": "-g"}),
    orjson.dumps({**PULL, "subject": "s" * 201}),
    orjson.dumps({**PULL, "seqs": [1]}),
    _without(PULL, "consumer"),
    _without(PULL, "group"),
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 1e3}',
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 1E2}',
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 100e-2}',
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 1e400}',
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 01}',
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 0, "max": 5}',
    b"[]",
    b"{}",
    b"nope",
]

ACK_BODIES: list[bytes] = [
    orjson.dumps(ACK),
    orjson.dumps({**ACK, "seqs": [0]}),
    orjson.dumps({**ACK, "seqs": [wire.MAX_SEQ]}),
    orjson.dumps({**ACK, "seqs": [wire.MAX_SEQ + 1]}),
    b'{"subject": "s", "group": "g", "consumer": "c", "seqs": [18446744073709551616]}',
    orjson.dumps({**ACK, "seqs": [-1]}),
    orjson.dumps({**ACK, "seqs": []}),
    orjson.dumps({**ACK, "seqs": list(range(wire.MAX_SEQS))}),
    orjson.dumps({**ACK, "seqs": list(range(wire.MAX_SEQS + 1))}),
    orjson.dumps({**ACK, "seqs": [104.0, 3]}),
    orjson.dumps({**ACK, "seqs": [104.5]}),
    orjson.dumps({**ACK, "seqs": ["1"]}),
    orjson.dumps({**ACK, "seqs": [True]}),
    orjson.dumps({**ACK, "seqs": [None]}),
    orjson.dumps({**ACK, "seqs": None}),
    orjson.dumps({**ACK, "seqs": 1}),
    orjson.dumps({**ACK, "delay_ms": 5}),  # a nack field
    b'{"subject": "s", "group": "g", "consumer": "c", "seqs": [1e300]}',
    b'{"subject": "s", "group": "g", "consumer": "c", "seqs": [9.223372036854775e18]}',
    b'{"subject": "s", "group": "g", "consumer": "c", "seqs": [9223372036854775807.0]}',
    _without(ACK, "seqs"),
]

NACK_BODIES: list[bytes] = [
    *ACK_BODIES[:-4],
    orjson.dumps({**ACK, "delay_ms": None, "error": None}),
    orjson.dumps({**ACK, "delay_ms": 0, "error": ""}),
    orjson.dumps({**ACK, "delay_ms": wire.MAX_NACK_DELAY_MS}),
    orjson.dumps({**ACK, "delay_ms": wire.MAX_NACK_DELAY_MS + 1}),
    orjson.dumps({**ACK, "delay_ms": 10.0}),
    orjson.dumps({**ACK, "delay_ms": "10"}),
    orjson.dumps({**ACK, "error": "e" * wire.MAX_ERROR_TEXT}),
    orjson.dumps({**ACK, "error": "e" * (wire.MAX_ERROR_TEXT + 1)}),
    orjson.dumps({**ACK, "error": 5}),
    orjson.dumps({**ACK, "mode": "shared"}),
]

CORPUS = [
    *[(bodies.ProduceBody, raw) for raw in PRODUCE_BODIES],
    *[(bodies.PullBody, raw) for raw in PULL_BODIES],
    *[(bodies.AckBody, raw) for raw in ACK_BODIES],
    *[(bodies.NackBody, raw) for raw in NACK_BODIES],
]

STRICTER = {
    # whole floats for integers, which JSON Schema and the models count as integers
    orjson.dumps({**PULL, "max": 5.0}),
    orjson.dumps({**PULL, "wait_ms": -0.0}),
    orjson.dumps({**PULL, "wait_ms": 100.0}),
    orjson.dumps({**PULL, "start": {"seq": 3.0}}),
    orjson.dumps({**ACK, "seqs": [104.0, 3]}),
    orjson.dumps({**ACK, "delay_ms": 10.0}),
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 1e3}',
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 1E2}',
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 100e-2}',
    b'{"subject": "s", "group": "g", "consumer": "c", "seqs": [9.223372036854775e18]}',
    # a key given twice: msgspec checks the first value too, the models only the last
    b'{"subject": "s", "group": "g", "consumer": "c", "max": 0, "max": 5}',
}


@pytest.mark.parametrize(("body", "raw"), CORPUS)
def test_the_decoder_answers_every_body_as_the_reference_model_does(
    body: type[Any], raw: bytes
) -> None:
    expected = _reference(raw, body)
    assert _ours(raw, body) == expected
    if raw not in STRICTER:
        assert _fast_accepts(raw, body) is (expected[0] == "ok")
    else:
        assert expected[0] == "ok"
        assert not _fast_accepts(raw, body)


def test_the_corpus_covers_acceptance_and_refusal_of_every_body() -> None:
    for body in bodies.REFERENCES:
        outcomes = {_reference(raw, body)[0] for kind, raw in CORPUS if kind is body}
        assert outcomes == {"ok", "error"}
    assert all(_reference(raw, body)[0] == "ok" for body, raw in CORPUS if raw in STRICTER)


def test_a_refused_body_is_answered_with_the_first_error_of_the_reference() -> None:
    raw = orjson.dumps({"messages": [{**ENVELOPE, "id": ""}, {**ENVELOPE, "subject": "!"}]})
    with pytest.raises(RequestError) as caught:
        bodies.decode(raw, bodies.ProduceBody)
    assert (caught.value.code, caught.value.field) == ("invalid_id", "messages[0].id")


_REFERENCE_TIMESTAMP = TypeAdapter(schemas.Timestamp, config=ConfigDict(strict=True))


def _reference_us(text: str) -> int | None:
    try:
        return (_REFERENCE_TIMESTAMP.validate_json(orjson.dumps(text)) - EPOCH) // US
    except ValidationError:
        return None


def _ours_us(text: str) -> int | None:
    try:
        return bodies.timestamp_us(text)
    except ValueError:
        return None


@pytest.mark.parametrize("text", TIMESTAMPS)
def test_a_timestamp_reads_as_the_same_instant_as_the_reference_reads_it(text: str) -> None:
    assert _ours_us(text) == _reference_us(text)


_DIGIT = st.sampled_from("0123456789")
_CANONICAL_LIKE = st.builds(
    lambda parts: "".join(parts),
    st.tuples(
        st.text(_DIGIT, min_size=4, max_size=4),
        st.sampled_from(["-", "-", "W", "/"]),
        st.text(_DIGIT, min_size=2, max_size=2),
        st.sampled_from(["-", "-", ":"]),
        st.text(_DIGIT, min_size=2, max_size=2),
        st.sampled_from(["T", "T", "t", " ", "_"]),
        st.text(_DIGIT, min_size=2, max_size=2),
        st.sampled_from([":", ":", ""]),
        st.text(_DIGIT, min_size=2, max_size=2),
        st.sampled_from([":", ":", "."]),
        st.text(_DIGIT, min_size=1, max_size=2),
        st.sampled_from(["", ".", ","]),
        st.text(_DIGIT | st.sampled_from("٣:+Z"), max_size=9),
        st.sampled_from(["Z", "z", "+00:00", "-01:30", "+0530", "", "+24:00"]),
    ),
)


@given(_CANONICAL_LIKE)
def test_near_canonical_timestamps_read_as_the_reference_reads_them(text: str) -> None:
    assert _ours_us(text) == _reference_us(text)


@given(
    st.datetimes(
        min_value=datetime(1, 1, 1),
        max_value=datetime(9999, 12, 31, 23, 59, 59, 999999),
        timezones=st.just(UTC),
    )
)
def test_every_canonical_timestamp_reads_exactly(value: datetime) -> None:
    text = value.isoformat().replace("+00:00", "Z")
    assert bodies.timestamp_us(text) == (value - EPOCH) // US == _reference_us(text)


@given(st.from_regex(r"\A\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,7})?Z\Z"))
def test_any_digits_in_the_canonical_layout_read_as_the_reference_reads_them(text: str) -> None:
    assert _ours_us(text) == _reference_us(text)
