"""Pull answers as records (``qmq_wire.records``) against a real broker: the SDK asks for
them, they carry every field a JSON answer does, and a client that does not ask gets JSON."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import orjson

from qmq_outbox import BrokerClient, Message, OutgoingMessage, calls
from qmq_wire.records import RECORDS_MEDIA_TYPE, read_records_answer
from tests.support.broker_process import BrokerProcess

CREATED = datetime(2026, 11, 30, 8, 15, 0, 123456, tzinfo=UTC)


def _json_pull(broker: BrokerProcess, doc: dict[str, object]) -> list[Message]:
    """A pull as a plain HTTP client makes it (no Accept): JSON."""
    response = httpx.post(f"{broker.url}/v1/pull", json=doc, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    return [Message.from_wire(m) for m in response.json()["messages"]]


def _fields(message: Message) -> tuple[object, ...]:
    return (
        message.id, message.subject, message.seq, message.attempt, message.key,
        message.headers, message.body, message.producer, message.created_at,
        message.stored_at, message.partition, message.tags,
    )  # fmt: skip


def test_records_carry_what_json_does_for_every_kind_of_message(broker: BrokerProcess) -> None:
    messages = [
        OutgoingMessage(id="plain", subject="rec.s", body=b'{"n": 1}'),
        OutgoingMessage(
            id="full",
            subject="rec.s",
            body="caf\u00e9".encode(),
            key="k-1",
            headers={"trace": "abc", "x": ""},
            producer="billing",
            created_at=CREATED,
            tags=["vip", "eu"],
        ),
        OutgoingMessage(id="binary", subject="rec.s", body=b"\x00\xff\xfe raw"),
    ]
    with BrokerClient(broker.url) as client:
        client.produce(messages)
        records = client.pull("rec.s", "records", "c1", max_messages=10)
    shown = _json_pull(broker, {"subject": "rec.s", "group": "json", "consumer": "c1", "max": 10})
    assert ("accept", RECORDS_MEDIA_TYPE) in calls.pull("rec.s", "records", "c1").headers
    assert [m.id for m in records] == ["plain", "full", "binary"]
    assert [_fields(m) for m in records] == [_fields(m) for m in shown]
    assert records[1].created_at == CREATED
    assert records[2].body == b"\x00\xff\xfe raw"


def test_an_ordered_subject_answers_its_partition_and_its_own_name(broker: BrokerProcess) -> None:
    with BrokerClient(broker.url) as client:
        client.declare_subject("rec.o", partitions=2)
        client.produce(
            [
                OutgoingMessage(id=f"o{i}", subject="rec.o", body=b"x", key=f"k{i}")
                for i in range(40)
            ]
        )
        records = client.pull("rec.o", "records", "c1", max_messages=100, mode="ordered")
    doc = {"subject": "rec.o", "group": "json", "consumer": "c1", "max": 100, "mode": "ordered"}
    shown = _json_pull(broker, doc)
    assert {m.subject for m in records} == {"rec.o"}
    assert {m.partition for m in records} == {0, 1}
    as_json = {m.id: _fields(m) for m in shown}
    both = [m for m in records if m.id in as_json]
    assert len(both) >= 16  # a partition's first keys: each group is served them
    assert all(_fields(m) == as_json[m.id] for m in both)


def test_an_ack_and_pull_in_records_answers_its_acks(broker: BrokerProcess) -> None:
    with BrokerClient(broker.url) as client:
        client.produce([OutgoingMessage(id=f"a{i}", subject="rec.a", body=b"x") for i in range(4)])
        first = client.pull("rec.a", "g", "c1", max_messages=2)
        answer = client.ack_and_pull("rec.a", "g", "c1", [m.seq for m in first] + [99])
        assert answer.acked == 2
        assert answer.unknown == [99]
        assert [m.id for m in answer.messages] == ["a2", "a3"]


def test_the_answer_is_records_only_for_a_client_that_asks(broker: BrokerProcess) -> None:
    with BrokerClient(broker.url) as client:
        client.produce([OutgoingMessage(id="r1", subject="rec.h", body=b"hi")])
    doc = {"subject": "rec.h", "group": "g", "consumer": "c", "max": 5, "ack": [7]}
    response = httpx.post(
        f"{broker.url}/v1/pull", json=doc, headers={"accept": RECORDS_MEDIA_TYPE}, timeout=10
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == RECORDS_MEDIA_TYPE
    fields, entries = read_records_answer(response.content, orjson.loads)
    assert fields == {"acked": 0, "unknown": [7]}
    ((attempt, partition, record),) = entries
    assert (attempt, partition, record[6], record[10]) == (1, None, "r1", b"hi")
    # errors stay JSON whatever the client accepts
    bad = httpx.post(
        f"{broker.url}/v1/pull",
        json={"subject": "rec.h", "group": "g", "consumer": "c", "max": 0},
        headers={"accept": RECORDS_MEDIA_TYPE},
        timeout=10,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["field"] == "max"
