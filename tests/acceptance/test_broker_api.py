"""API v1 against a real broker process over HTTP: every endpoint and delivery semantic."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerRejected
from tests.support.broker_process import BrokerProcess


def msg(i: int | str, subject: str = "orders", body: bytes | None = None) -> OutgoingMessage:
    return OutgoingMessage(
        id=f"id-{i}",
        subject=subject,
        body=body if body is not None else f"body-{i}".encode(),
        producer="tests",
    )


@pytest.fixture
def fast_broker(broker_factory: type[BrokerProcess], tmp_path: Path) -> BrokerProcess:
    """Short leases and few attempts so expiry and dead letters happen in test time."""
    return broker_factory(
        tmp_path / "data",
        extra_args=["--ack-timeout", "1s", "--max-attempts", "2", "--max-body-size", "2048"],
    ).start()


@pytest.fixture
def client(fast_broker: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(fast_broker.url) as c:
        yield c


@pytest.fixture
def http(fast_broker: BrokerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fast_broker.url, timeout=10) as c:
        yield c


def post(http: httpx.Client, path: str, doc: Any) -> httpx.Response:
    return http.post(path, content=orjson.dumps(doc), headers={"content-type": "application/json"})


def test_produce_pull_ack_round_trip(client: BrokerClient) -> None:
    results = client.produce([msg(1), msg(2), msg(3, body=b"\xff\x00binary")])
    assert [(r.status, r.seq) for r in results] == [("stored", 0), ("stored", 1), ("stored", 2)]
    pulled = client.pull("orders", "billing", "c1", max_messages=10)
    assert [(m.id, m.seq, m.attempt) for m in pulled] == [
        ("id-1", 0, 1),
        ("id-2", 1, 1),
        ("id-3", 2, 1),
    ]
    assert pulled[2].body == b"\xff\x00binary"
    assert pulled[0].producer == "tests"
    assert pulled[0].stored_at is not None
    assert client.ack("orders", "billing", "c1", [0, 1, 2, 7]) == {"acked": 3, "unknown": [7]}
    stats = client.subject("orders")
    assert stats["messages"] == 3
    assert stats["next_seq"] == 3
    assert stats["groups"] == [
        {
            "group": "billing",
            "mode": "shared",
            "backlog": 0,
            "in_flight": 0,
            "retrying": 0,
            "dead": 0,
            "acked": 3,
            "filtered": 0,
            "tags": [],
        }
    ]
    assert client.subjects()[0]["subject"] == "orders"


def test_duplicate_ids_are_answered_with_the_original_seq(client: BrokerClient) -> None:
    client.produce([msg(1), msg(2)])
    results = client.produce([msg(2), msg(3), msg(3)])
    assert [(r.status, r.seq) for r in results] == [
        ("duplicate", 1),
        ("stored", 2),
        ("duplicate", 2),
    ]
    # the same id on another subject is another message
    assert client.produce([msg(1, subject="payments")])[0].status == "stored"


def test_shared_group_divides_messages_between_consumers(client: BrokerClient) -> None:
    client.produce([msg(i) for i in range(10)])
    first = client.pull("orders", "g", "a", max_messages=4)
    second = client.pull("orders", "g", "b", max_messages=100)
    assert [m.seq for m in first] == [0, 1, 2, 3]
    assert [m.seq for m in second] == [4, 5, 6, 7, 8, 9]


def test_broadcast_gives_every_consumer_every_message(client: BrokerClient) -> None:
    client.produce([msg(i) for i in range(3)])
    for consumer in ("a", "b", "c"):
        got = client.pull("orders", "notify", consumer, max_messages=10, mode="broadcast")
        assert [m.seq for m in got] == [0, 1, 2]
    assert client.ack("orders", "notify", "a", [0, 1, 2])["acked"] == 3
    assert client.pull("orders", "notify", "b", max_messages=10, mode="broadcast") == []
    group = client.subject("orders")["groups"][0]
    assert (group["mode"], group["acked"], group["in_flight"]) == ("broadcast", 3, 6)


def test_mode_conflict_is_409(client: BrokerClient, http: httpx.Client) -> None:
    client.produce([msg(1)])
    client.pull("orders", "g", "a")
    response = post(
        http, "/v1/pull", {"subject": "orders", "group": "g", "consumer": "a", "mode": "broadcast"}
    )
    assert response.status_code == 409
    assert response.json()["error"]["field"] == "mode"


def test_start_latest_skips_the_backlog(client: BrokerClient) -> None:
    client.produce([msg(i) for i in range(5)])
    assert client.pull("orders", "late", "a", start="latest") == []
    client.produce([msg(9)])
    assert [m.seq for m in client.pull("orders", "late", "a")] == [5]


def test_lease_expiry_redelivers_then_dead_letters(client: BrokerClient) -> None:
    client.produce([msg(1)])
    assert [m.attempt for m in client.pull("orders", "g", "a")] == [1]
    assert client.pull("orders", "g", "a") == []  # leased
    again = client.pull("orders", "g", "b", wait_ms=3000)  # after the 1 s lease expires
    assert [(m.seq, m.attempt) for m in again] == [(0, 2)]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and client.subject("orders")["groups"][0]["dead"] == 0:
        client.pull("orders", "g", "b", wait_ms=200)
    dead = client.dead_letters("orders", "g")["dead"]
    assert [(d["seq"], d["attempts"], d["error"]) for d in dead] == [(0, 2, "lease expired")]
    assert dead[0]["message"]["id"] == "id-1"


def test_nack_retries_with_delay_before_new_messages_and_redrive(client: BrokerClient) -> None:
    client.produce([msg(1), msg(2)])
    first = client.pull("orders", "g", "a", max_messages=1)
    assert client.nack("orders", "g", "a", [first[0].seq], delay_ms=300, error="try later") == {
        "retrying": 1,
        "dead": 0,
    }
    began = time.monotonic()
    assert [m.seq for m in client.pull("orders", "g", "a", max_messages=1)] == [
        1
    ]  # retry not due yet
    redelivered = client.pull("orders", "g", "a", max_messages=5, wait_ms=2000)
    assert time.monotonic() - began >= 0.25
    assert [(m.seq, m.attempt) for m in redelivered] == [(0, 2)]
    assert client.nack("orders", "g", "a", [0], error="boom") == {"retrying": 0, "dead": 1}
    dead = client.dead_letters("orders", "g")["dead"]
    assert [(d["seq"], d["error"]) for d in dead] == [(0, "boom")]
    assert client.redrive("orders", "g", [0]) == 1
    assert [(m.seq, m.attempt) for m in client.pull("orders", "g", "a", max_messages=5)] == [(0, 1)]


def test_default_backoff_is_one_second(client: BrokerClient) -> None:
    client.produce([msg(1)])
    client.pull("orders", "g", "a")
    client.nack("orders", "g", "a", [0])
    began = time.monotonic()
    again = client.pull("orders", "g", "a", wait_ms=3000)
    assert [m.attempt for m in again] == [2]
    assert 0.8 <= time.monotonic() - began <= 2.0


def test_dead_letter_listing_pages(client: BrokerClient, http: httpx.Client) -> None:
    client.produce([msg(i) for i in range(5)])
    pulled = client.pull("orders", "g", "a", max_messages=5)
    assert client.nack("orders", "g", "a", [m.seq for m in pulled], delay_ms=0)["retrying"] == 5
    pulled = client.pull("orders", "g", "a", max_messages=5)
    assert {m.attempt for m in pulled} == {2}
    assert client.nack("orders", "g", "a", [m.seq for m in pulled])["dead"] == 5
    page = client.dead_letters("orders", "g", limit=2)
    assert [d["seq"] for d in page["dead"]] == [0, 1]
    assert page["next_after_seq"] == 1
    rest = client.dead_letters("orders", "g", limit=10, after_seq=1)
    assert [d["seq"] for d in rest["dead"]] == [2, 3, 4]
    assert client.redrive("orders", "g") == 5
    assert post(http, "/v1/subjects/orders/groups/g/dead/redrive", {}).status_code == 400
    assert http.get("/v1/subjects/orders/groups/nope/dead").status_code == 404


def test_long_poll_returns_as_soon_as_a_message_arrives(
    client: BrokerClient, fast_broker: BrokerProcess
) -> None:
    result: dict[str, Any] = {}

    def waiter() -> None:
        with BrokerClient(fast_broker.url) as own:
            result["messages"] = own.pull("orders", "g", "a", wait_ms=10_000)
            result["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    produced_at = time.monotonic()
    client.produce([msg(1)])
    thread.join(5)
    assert [m.id for m in result["messages"]] == ["id-1"]
    assert result["at"] - produced_at < 0.5


def test_long_poll_times_out_empty(client: BrokerClient) -> None:
    began = time.monotonic()
    assert client.pull("orders", "g", "a", wait_ms=300) == []
    assert 0.25 <= time.monotonic() - began < 2


def test_health_metrics_and_openapi(client: BrokerClient, http: httpx.Client) -> None:
    client.produce([msg(1)])
    client.pull("orders", "g", "a")
    assert http.get("/healthz").json() == {"status": "ok"}
    metrics = http.get("/metrics").text
    assert "qmq_broker_produced_messages_total 1.0" in metrics
    assert 'qmq_broker_group_in_flight_messages{group="g",subject="orders"} 1.0' in metrics
    assert "qmq_broker_fsync_seconds_count" in metrics
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in (
        "/v1/messages",
        "/v1/pull",
        "/v1/ack",
        "/v1/nack",
        "/v1/subjects/{subject}/groups/{group}/dead/redrive",
    ):
        assert path in spec["paths"]
    assert "Envelope" in spec["components"]["schemas"]


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
        b'{"messages": [{"id": "1", "subject": "../etc", "body": "x"}]}',
        400,
        "invalid_subject",
        "messages[0].subject",
    ),
    (
        b'{"messages": [{"id": "1", "subject": "a/b", "body": "x"}]}',
        400,
        "invalid_subject",
        "messages[0].subject",
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
        b'{"messages": [{"id": "1", "subject": "' + b"a" * 201 + b'", "body": "x"}]}',
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
        b'{"messages": [{"id": "1", "subject": "a", "body": "x", "created_at": "yesterday"}]}',
        400,
        "invalid_created_at",
        "messages[0].created_at",
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
]


@pytest.mark.parametrize(("body", "status", "code", "field"), BAD_PRODUCE)
def test_bad_produce_requests_name_the_field(
    http: httpx.Client, body: bytes, status: int, code: str, field: str | None
) -> None:
    response = http.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["field"]) == (code, field)
    assert error["message"]


def test_a_rejected_batch_stores_nothing(client: BrokerClient, http: httpx.Client) -> None:
    good = [msg(i).to_wire() for i in range(3)]
    bad = [*good, {"id": "x", "subject": "bad/subject", "body": "b"}]
    assert (
        post(http, "/v1/messages", {"messages": bad}).json()["error"]["field"]
        == "messages[3].subject"
    )
    too_big = [*good, {"id": "y", "subject": "orders", "body": "z" * 5000}]
    response = post(http, "/v1/messages", {"messages": too_big})
    assert response.status_code == 413
    assert response.json()["error"]["field"] == "messages[3].body"
    assert client.subjects() == []
    assert [r.status for r in client.produce([msg(0)])] == ["stored"]


def test_batch_size_and_request_size_limits(http: httpx.Client) -> None:
    many = {"messages": [msg(i).to_wire() for i in range(1001)]}
    assert post(http, "/v1/messages", many).json()["error"]["code"] == "invalid_messages"
    huge = b'{"messages": [' + b" " * (65 * 1024 * 1024) + b"]}"
    response = http.post("/v1/messages", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


BAD_PULLS = [
    ({"group": "g", "consumer": "c"}, "missing_field", "subject"),
    ({"subject": "orders", "group": "g", "consumer": "c", "max": 0}, "invalid_max", "max"),
    ({"subject": "orders", "group": "g", "consumer": "c", "max": 1001}, "invalid_max", "max"),
    ({"subject": "orders", "group": "g", "consumer": "c", "max": "5"}, "invalid_max", "max"),
    (
        {"subject": "orders", "group": "g", "consumer": "c", "wait_ms": 60001},
        "invalid_wait_ms",
        "wait_ms",
    ),
    (
        {"subject": "orders", "group": "g", "consumer": "c", "mode": "fanout"},
        "invalid_mode",
        "mode",
    ),
    (
        {"subject": "orders", "group": "g", "consumer": "c", "start": "middle"},
        "invalid_start",
        "start",
    ),
    ({"subject": "orders", "group": "g/x", "consumer": "c"}, "invalid_group", "group"),
    ({"subject": "orders", "group": "g", "consumer": ""}, "invalid_consumer", "consumer"),
]


@pytest.mark.parametrize(("doc", "code", "field"), BAD_PULLS)
def test_bad_pulls_name_the_field(
    http: httpx.Client, doc: dict[str, Any], code: str, field: str
) -> None:
    response = post(http, "/v1/pull", doc)
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["field"]) == (code, field)


def test_bad_acks_and_unknown_groups(client: BrokerClient, http: httpx.Client) -> None:
    client.produce([msg(1)])
    base = {"subject": "orders", "group": "g", "consumer": "c"}
    assert post(http, "/v1/ack", {**base, "seqs": []}).json()["error"]["field"] == "seqs"
    assert post(http, "/v1/ack", {**base, "seqs": [-1]}).json()["error"]["field"] == "seqs[0]"
    assert post(http, "/v1/ack", {**base, "seqs": [1]}).status_code == 404
    assert (
        post(http, "/v1/nack", {**base, "seqs": [1], "delay_ms": -5}).json()["error"]["field"]
        == "delay_ms"
    )
    assert http.get("/v1/subjects/nope").status_code == 404
    assert http.get("/v1/subjects/orders/groups/g/dead?limit=0").json()["error"]["field"] == "limit"
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/messages").status_code == 405


def test_base64_bodies_round_trip(client: BrokerClient, http: httpx.Client) -> None:
    raw = bytes(range(256))
    wire = {
        "id": "b",
        "subject": "orders",
        "body": base64.b64encode(raw).decode(),
        "body_encoding": "base64",
    }
    assert post(http, "/v1/messages", {"messages": [wire]}).status_code == 200
    (message,) = client.pull("orders", "g", "c")
    assert message.body == raw


def test_sigterm_finishes_in_flight_checkpoints_and_exits_zero(
    fast_broker: BrokerProcess, client: BrokerClient
) -> None:
    client.produce([msg(i) for i in range(10)])
    client.pull("orders", "g", "a", max_messages=4)
    client.ack("orders", "g", "a", [0, 1])
    result: dict[str, Any] = {}

    def waiter() -> None:
        with BrokerClient(fast_broker.url) as own:
            began = time.monotonic()
            result["messages"] = own.pull("orders", "other", "a", wait_ms=30_000, start="latest")
            result["took"] = time.monotonic() - began

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    assert fast_broker.terminate(timeout=15) == 0
    thread.join(5)
    assert result["messages"] == []
    assert result["took"] < 5
    assert (fast_broker.data_dir / "checkpoint.json").exists()
    assert "broker.stopped" in fast_broker.log_tail(50)
    fast_broker.restart()
    group = client.subject("orders")["groups"]
    assert [(g["group"], g["acked"], g["in_flight"], g["backlog"]) for g in group] == [
        ("g", 2, 2, 6),
        ("other", 0, 0, 0),
    ]


def test_corrupted_record_is_detected_and_never_served(
    fast_broker: BrokerProcess, client: BrokerClient
) -> None:
    client.produce([msg(i, body=f"payload-{i}".encode()) for i in range(3)])
    assert fast_broker.terminate() == 0
    segment = sorted((fast_broker.data_dir / "messages").iterdir())[-1]
    data = bytearray(segment.read_bytes())
    at = data.find(b"payload-1")
    data[at] ^= 0xFF
    segment.write_bytes(bytes(data))
    fast_broker.restart()
    delivered = client.pull("orders", "g", "a", max_messages=10)
    assert [m.seq for m in delivered] == [0, 2]
    dead = client.dead_letters("orders", "g")["dead"]
    assert [(d["seq"], d["error"], d["message"]) for d in dead] == [(1, "unreadable record", None)]
    assert "broker.unreadable" in fast_broker.log_tail(50)


def test_auth_tokens_and_rights(broker_factory: type[BrokerProcess], tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_bytes(
        orjson.dumps(
            {
                "tokens": [
                    {
                        "name": "orders-svc",
                        "token": "t-orders",
                        "produce": ["order.*"],
                        "consume": [],
                    },
                    {
                        "name": "billing",
                        "token": "t-billing",
                        "produce": [],
                        "consume": ["order.*"],
                    },
                ]
            }
        )
    )
    proc = broker_factory(tmp_path / "d", extra_args=["--auth-file", str(tokens)]).start()
    one = msg(1, subject="order.created")
    with BrokerClient(proc.url) as anonymous, pytest.raises(BrokerRejected, match="401"):
        anonymous.produce([one])
    with BrokerClient(proc.url, token="wrong") as wrong, pytest.raises(BrokerRejected, match="401"):
        wrong.produce([one])
    with BrokerClient(proc.url, token="t-orders") as producer:
        assert producer.produce([one])[0].status == "stored"
        with pytest.raises(BrokerRejected, match=r"403 forbidden \(messages\[0\]\.subject\)"):
            producer.produce([msg(2, subject="payment.done")])
        with pytest.raises(BrokerRejected, match="403 forbidden"):
            producer.pull("order.created", "g", "c")
    with BrokerClient(proc.url, token="t-billing") as consumer:
        assert [m.id for m in consumer.pull("order.created", "g", "c")] == ["id-1"]
    assert httpx.get(f"{proc.url}/healthz").status_code == 200
