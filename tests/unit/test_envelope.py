"""The SDK's message records: frozen dataclasses built cheaply, timestamps parsed lazily."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from datetime import UTC, datetime, timedelta, timezone

import pytest

from qmq_outbox.envelope import (
    Message,
    OutgoingMessage,
    ProduceResult,
    format_timestamp,
    parse_timestamp,
)

WIRE = {
    "id": "m-1",
    "subject": "orders",
    "seq": 7,
    "attempt": 2,
    "key": "k",
    "headers": {"traceparent": "00-abc"},
    "body": '{"n": 1}',
    "body_encoding": "utf-8",
    "producer": "shop",
    "created_at": "2024-05-01T10:00:00.123456Z",
    "stored_at": "2024-05-01T12:00:00.5+02:00",
}
CREATED = datetime(2024, 5, 1, 10, 0, 0, 123456, tzinfo=UTC)
STORED = datetime(2024, 5, 1, 10, 0, 0, 500000, tzinfo=UTC)


def eager(**changes: object) -> Message:
    """The message WIRE describes, built field by field."""
    fields: dict[str, object] = {
        "id": "m-1",
        "subject": "orders",
        "seq": 7,
        "attempt": 2,
        "key": "k",
        "headers": {"traceparent": "00-abc"},
        "body": b'{"n": 1}',
        "producer": "shop",
        "created_at": CREATED,
        "stored_at": STORED,
    }
    return Message(**{**fields, **changes})  # type: ignore[arg-type]


def test_outgoing_defaults_and_immutability() -> None:
    one = OutgoingMessage(id="a", subject="s", body=b"x")
    two = OutgoingMessage(id="a", subject="s", body=b"x")
    assert (one.key, one.headers, one.producer, one.created_at, one.deliver_at) == (
        None,
        {},
        None,
        None,
        None,
    )
    assert one == two
    assert one.headers is not two.headers  # each its own dict, as with default_factory
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.id = "b"  # type: ignore[misc]
    assert dataclasses.replace(one, id="b") == OutgoingMessage(id="b", subject="s", body=b"x")
    assert dataclasses.asdict(one)["body"] == b"x"
    assert "OutgoingMessage(id='a'" in repr(one)


def test_outgoing_wire_form() -> None:
    at = datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=2)))
    message = OutgoingMessage(
        id="a",
        subject="s",
        body=b"\xff\x00",
        key="k",
        headers={"h": "v"},
        producer="p",
        created_at=at,
        deliver_at=at,
    )
    assert message.to_wire() == {
        "id": "a",
        "subject": "s",
        "body": "/wA=",
        "body_encoding": "base64",
        "key": "k",
        "headers": {"h": "v"},
        "producer": "p",
        "created_at": "2024-01-02T01:04:05.000006Z",
        "deliver_at": "2024-01-02T01:04:05.000006Z",
    }
    assert OutgoingMessage(id="a", subject="s", body=b"{}").to_wire() == {
        "id": "a",
        "subject": "s",
        "body": "{}",
        "body_encoding": "utf-8",
    }


def test_produce_results_from_the_wire() -> None:
    wire = {"id": "a", "subject": "s", "status": "stored", "seq": 3}
    expected = ProduceResult(id="a", subject="s", status="stored", seq=3)
    assert ProduceResult.from_wire(wire) == expected
    assert vars(ProduceResult.from_wire(wire)) is not wire
    owned = dict(wire)
    adopted = ProduceResult.adopt(owned)
    assert adopted == expected
    assert vars(adopted) is owned  # taken over, not copied
    scheduled = ProduceResult.adopt({"id": "a", "subject": "s", "status": "scheduled"})
    assert scheduled.seq is None
    extra = ProduceResult.adopt({**wire, "later": "field"})
    assert extra == expected
    assert not hasattr(extra, "later")
    with pytest.raises(dataclasses.FrozenInstanceError):
        adopted.seq = 4  # type: ignore[misc]


def test_from_wire_leaves_its_input_alone_and_adopt_takes_it_over() -> None:
    headers = {"h": "v"}
    wire = {**WIRE, "headers": headers}
    before = {**wire, "headers": dict(headers)}
    message = Message.from_wire(wire)
    assert wire == before
    assert message.headers is not headers
    owned = dict(wire)
    adopted = Message.adopt(owned)
    assert vars(adopted) is owned
    assert adopted == message == eager(headers={"h": "v"})


def test_unknown_and_missing_wire_fields() -> None:
    wire = {k: v for k, v in WIRE.items() if k not in ("key", "producer", "body_encoding")}
    message = Message.adopt({**wire, "from_a_later_broker": 1})
    assert message == eager(key=None, producer=None)
    assert "from_a_later_broker" not in vars(message)
    with pytest.raises(KeyError):
        Message.adopt({k: v for k, v in WIRE.items() if k != "seq"})


def test_a_delivered_message_equals_its_eager_twin() -> None:
    message = Message.from_wire(dict(WIRE))
    assert message == eager()
    assert message.json() == {"n": 1}
    assert message.text() == '{"n": 1}'
    assert message.headers == {"traceparent": "00-abc"}


def test_timestamps_are_parsed_when_first_read() -> None:
    message = Message.from_wire(dict(WIRE))
    assert "created_at" not in vars(message)
    assert "stored_at" not in vars(message)
    assert message.created_at == CREATED
    assert message.created_at is message.created_at  # parsed once
    assert message.created_at.tzinfo is UTC
    assert "stored_at" not in vars(message)
    assert message.stored_at == STORED
    assert message.stored_at.tzinfo is UTC


def test_missing_timestamps_are_none() -> None:
    wire = {k: v for k, v in WIRE.items() if k not in ("created_at", "stored_at", "headers")}
    message = Message.from_wire(wire)
    assert (message.created_at, message.stored_at, message.headers) == (None, None, {})
    nulls = Message.adopt({**WIRE, "created_at": None, "stored_at": "", "headers": None})
    assert (nulls.created_at, nulls.stored_at, nulls.headers) == (None, None, {})


def test_a_base64_body() -> None:
    message = Message.from_wire({**WIRE, "body": "/wA=", "body_encoding": "base64"})
    assert message.body == b"\xff\x00"


def test_a_delivered_message_is_immutable() -> None:
    message = Message.from_wire(dict(WIRE))
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.created_at = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del message.body
    assert message.created_at == CREATED


def test_unknown_attributes_are_still_attribute_errors() -> None:
    message = Message.from_wire(dict(WIRE))
    with pytest.raises(AttributeError, match="no attribute 'bdy'"):
        message.bdy  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(message, "_created_at_text_x")
    assert getattr(message, "__deepcopy__", None) is None


@pytest.mark.parametrize("read_first", [False, True])
def test_copies_pickles_and_replacements(read_first: bool) -> None:
    message = Message.from_wire(dict(WIRE))
    if read_first:
        assert message.stored_at == STORED
    assert pickle.loads(pickle.dumps(message)) == eager()
    assert copy.copy(message) == eager()
    assert copy.deepcopy(message) == eager()
    assert dataclasses.replace(message, attempt=3) == eager(attempt=3)
    assert dataclasses.asdict(message)["created_at"] == CREATED
    assert "created_at=datetime.datetime(2024, 5, 1, 10, 0, 0, 123456" in repr(message)


def test_timestamps_on_the_wire_and_back() -> None:
    assert parse_timestamp("2024-05-01T10:00:00Z") == datetime(2024, 5, 1, 10, tzinfo=UTC)
    assert parse_timestamp("2024-05-01T10:00:00-01:30").tzinfo is UTC
    assert parse_timestamp("2024-05-01T10:00:00-01:30") == datetime(2024, 5, 1, 11, 30, tzinfo=UTC)
    assert format_timestamp(datetime(2024, 5, 1, 10)) == "2024-05-01T10:00:00Z"
    assert parse_timestamp(format_timestamp(CREATED)) == CREATED
