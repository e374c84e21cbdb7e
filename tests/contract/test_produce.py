"""Produce: stored, duplicate and scheduled answers; all-or-nothing rejection naming the field."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerRejected
from tests.contract.conftest import MAX_BODY, Target


def msg(i: int | str, subject: str, **fields: object) -> OutgoingMessage:
    return OutgoingMessage(id=f"id-{i}", subject=subject, body=f"body-{i}".encode(), **fields)  # type: ignore[arg-type]


def test_stored_then_duplicate_with_the_original_seq(target: Target) -> None:
    orders, payments = target.subject(), target.subject("payments")
    first = target.client.produce([msg(1, orders), msg(2, orders)])
    assert [(r.id, r.status, r.seq) for r in first] == [
        ("id-1", "stored", 0),
        ("id-2", "stored", 1),
    ]
    again = target.client.produce([msg(2, orders), msg(3, orders), msg(3, orders)])
    assert [(r.status, r.seq) for r in again] == [("duplicate", 1), ("stored", 2), ("duplicate", 2)]
    assert target.client.produce([msg(1, payments)])[0].status == "stored"


def test_future_deliver_at_is_scheduled_without_a_seq(target: Target) -> None:
    subject = target.subject()
    later = datetime.now(UTC) + timedelta(hours=1)
    (result,) = target.client.produce([msg(1, subject, deliver_at=later)])
    assert (result.status, result.seq) == ("scheduled", None)
    (again,) = target.client.produce([msg(1, subject, deliver_at=later)])
    assert (again.status, again.seq) == ("duplicate", None)
    stats = target.client.subject(subject)
    assert (stats["messages"], stats["scheduled"]["messages"], stats["groups"]) == (0, 1, [])
    past = datetime.now(UTC) - timedelta(hours=1)
    (now,) = target.client.produce([msg(2, subject, deliver_at=past)])
    assert (now.status, now.seq) == ("stored", 0)


def test_a_rejected_batch_stores_nothing_and_names_the_field(target: Target) -> None:
    subject = target.subject()
    good = [msg(i, subject).to_wire() for i in range(3)]
    bad = target.post("/v1/messages", {"messages": [*good, {**good[0], "subject": "bad/one"}]})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_subject"
    assert bad.json()["error"]["field"] == "messages[3].subject"
    too_big = target.post(
        "/v1/messages",
        {"messages": [*good, {**good[0], "id": "big", "body": "z" * (MAX_BODY + 1)}]},
    )
    assert too_big.status_code == 413
    assert too_big.json()["error"] == {
        "code": "body_too_large",
        "message": too_big.json()["error"]["message"],
        "field": "messages[3].body",
    }
    assert subject not in [s["subject"] for s in target.client.subjects()]
    with pytest.raises(BrokerRejected) as rejected:
        target.client.produce([msg(9, "bad subject")])
    assert (rejected.value.status, rejected.value.code) == (400, "invalid_subject")
    assert rejected.value.field == "messages[0].subject"


BAD_PRODUCE = [
    (b"{not json", 400, "invalid_json", None),
    (b"[]", 400, "invalid_body", None),
    (b'{"messages": []}', 400, "invalid_messages", "messages"),
    (b'{"messages": [{"subject": "a", "body": "x"}]}', 400, "missing_field", "messages[0].id"),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": "x", "colour": 1}]}',
        400,
        "unknown_field",
        "messages[0].colour",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a\\u0000b", "body": "x"}]}',
        400,
        "invalid_subject",
        "messages[0].subject",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "_qmq.internal", "body": "x"}]}',
        400,
        "invalid_subject",
        "messages[0].subject",
    ),
    (
        b'{"messages": [{"id": "caf\\u00e9", "subject": "a", "body": "x"}]}',
        400,
        "invalid_id",
        "messages[0].id",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": 5}]}',
        400,
        "invalid_body",
        "messages[0].body",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": "!!", "body_encoding": "base64"}]}',
        400,
        "invalid_body",
        "messages[0].body",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": "x", "body_encoding": "rot13"}]}',
        400,
        "invalid_body_encoding",
        "messages[0].body_encoding",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": "x", '
        b'"created_at": "2026-01-01T00:00:00"}]}',
        400,
        "invalid_created_at",
        "messages[0].created_at",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": "x", "key": 5}]}',
        400,
        "invalid_key",
        "messages[0].key",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": "x", "headers": {"a": 1}}]}',
        400,
        "invalid_headers",
        "messages[0].headers.a",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a", "body": "x", '
        b'"deliver_at": "2999-01-01T00:00:00Z"}]}',
        400,
        "delay_too_long",
        "messages[0].deliver_at",
    ),
]


@pytest.mark.parametrize(("body", "status", "code", "field"), BAD_PRODUCE)
def test_bad_produce_requests(
    target: Target, body: bytes, status: int, code: str, field: str | None
) -> None:
    response = target.http.post("/v1/messages", content=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["field"]) == (code, field)
    assert error["message"]


async def test_the_async_client_produces_and_pulls(target: Target) -> None:
    subject = target.subject()
    async with target.make_async_client() as client:
        results = await client.produce([msg(1, subject, headers={"traceparent": "00-a-b-01"})])
        assert [(r.status, r.seq) for r in results] == [("stored", 0)]
        (message,) = await client.pull(subject, "g", "c", wait_ms=1000)
        assert (message.id, message.headers, message.body) == (
            "id-1",
            {"traceparent": "00-a-b-01"},
            b"body-1",
        )
        assert await client.ack(subject, "g", "c", [0]) == {"acked": 1, "unknown": []}
