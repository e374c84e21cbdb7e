"""``BrokerClient`` / ``AsyncBrokerClient`` on their two paths: the SDK's own transport
(the default for ``http://``) and any transport a user injects (httpx.Client's path).

Both must send the same requests and give the same answers and errors; a scripted server
stands in for the broker, over real sockets.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable
from tests.unit.http_script import Reply, ScriptedServer, Seen, ok, scripted

pytestmark = pytest.mark.timeout(30)

DELIVERED = {
    "id": "m-1",
    "subject": "orders",
    "seq": 1,
    "attempt": 1,
    "key": None,
    "headers": {},
    "body": '{"n": 1}',
    "body_encoding": "utf-8",
    "producer": None,
    "created_at": "2024-05-01T10:00:00Z",
    "stored_at": "2024-05-01T10:00:01Z",
}


def broker_like(seen: Seen) -> Reply:
    """Answers shaped like the broker's, and its errors on demand."""
    if seen.path == "/v1/messages":
        doc = orjson.loads(seen.body)
        results = [
            {"id": m["id"], "subject": m["subject"], "status": "stored", "seq": n}
            for n, m in enumerate(doc["messages"], 1)
        ]
        return ok(orjson.dumps({"results": results}))
    if seen.path == "/v1/pull":
        return ok(orjson.dumps({"messages": [DELIVERED]}))
    if seen.path == "/v1/ack":
        error = {"code": "invalid_seqs", "message": "no seqs", "field": "seqs"}
        return ok(orjson.dumps({"error": error}), status="400 Bad Request")
    if seen.path == "/v1/subjects":
        return ok(b'{"error": {"code": "read_only", "message": "disk"}}', status="503 Nope")
    if seen.path == "/v1/subjects/slow":
        return Reply(ok(b"{}").data, delay=1.0)
    return ok(b"<html>oops</html>", status="500 Internal Server Error")


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with scripted(broker_like) as server:
        yield server


Outcome = Any  # an answer, or the type, status and code of the error raised


def outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return call()
    except BrokerRejected as exc:
        return ("rejected", exc.status, exc.code, exc.field, str(exc))
    except BrokerUnavailable as exc:
        return ("unavailable", str(exc).split(":")[0])


def exercise_sync(client: BrokerClient) -> list[Outcome]:
    messages = [OutgoingMessage(id=f"i{n}", subject="orders", body=b"{}") for n in range(3)]
    with client:
        return [
            outcome(lambda: client.produce(messages)),
            outcome(lambda: client.pull("orders", "g", "c", max_messages=5)),
            outcome(lambda: client.ack("orders", "g", "c", [1])),
            outcome(lambda: client.subjects()),
            outcome(lambda: client.subject("slow")),
            outcome(lambda: client.dead_letters("x", "g")),
        ]


def exercise_async(client: AsyncBrokerClient) -> list[Outcome]:
    async def attempt(call: Callable[[], Any]) -> Outcome:
        try:
            return await call()
        except BrokerRejected as exc:
            return ("rejected", exc.status, exc.code, exc.field, str(exc))
        except BrokerUnavailable as exc:
            return ("unavailable", str(exc).split(":")[0])

    async def main() -> list[Outcome]:
        messages = [OutgoingMessage(id=f"i{n}", subject="orders", body=b"{}") for n in range(3)]
        async with client:
            return [
                await attempt(lambda: client.produce(messages)),
                await attempt(lambda: client.pull("orders", "g", "c", max_messages=5)),
                await attempt(lambda: client.ack("orders", "g", "c", [1])),
                await attempt(lambda: client.subjects()),
                await attempt(lambda: client.subject("slow")),
                await attempt(lambda: client.dead_letters("x", "g")),
            ]

    return asyncio.run(main())


EXPECTED = [
    [ProduceResult(id=f"i{n}", subject="orders", status="stored", seq=n + 1) for n in range(3)],
    [Message.from_wire(dict(DELIVERED))],
    ("rejected", 400, "invalid_seqs", "seqs", "broker answered 400 invalid_seqs (seqs): no seqs"),
    ("unavailable", "broker answered 503 read_only"),
    ("unavailable", "broker unreachable"),  # the read timed out
    ("unavailable", "broker answered 500 http_error"),
]


def requests_seen(server: ScriptedServer) -> list[tuple[str, str, bytes, dict[str, str]]]:
    keep = ("content-type", "authorization", "content-length", "host")
    return [
        (s.method, s.path, s.body, {k: v for k, v in s.headers.items() if k in keep})
        for s in server.seen
    ]


def test_the_default_sync_client_and_an_injected_transport_agree(server: ScriptedServer) -> None:
    options: dict[str, Any] = {"token": "t0k", "timeout": 0.5}
    default = BrokerClient(server.url, **options)
    assert default._direct is not None  # the SDK's own transport, sent to directly
    assert exercise_sync(default) == EXPECTED
    ours = requests_seen(server)
    server.seen.clear()
    injected = BrokerClient(server.url, transport=httpx.HTTPTransport(), **options)
    assert injected._direct is None
    assert exercise_sync(injected) == EXPECTED
    assert requests_seen(server) == ours
    assert ours[0][3]["authorization"] == "Bearer t0k"


def test_the_default_async_client_and_an_injected_transport_agree(
    server: ScriptedServer,
) -> None:
    options: dict[str, Any] = {"token": "t0k", "timeout": 0.5}
    default = AsyncBrokerClient(server.url, **options)
    assert default._direct is not None
    assert exercise_async(default) == EXPECTED
    ours = requests_seen(server)
    server.seen.clear()
    injected = AsyncBrokerClient(server.url, transport=httpx.AsyncHTTPTransport(), **options)
    assert exercise_async(injected) == EXPECTED
    assert requests_seen(server) == ours


def test_an_unreachable_broker_is_unavailable() -> None:
    with scripted(broker_like) as server:
        url = server.url
    with BrokerClient(url) as client, pytest.raises(BrokerUnavailable, match="unreachable"):
        client.pull("orders", "g", "c")


def test_a_closed_client_refuses_to_send_on_either_path(server: ScriptedServer) -> None:
    for client in (
        BrokerClient(server.url),
        BrokerClient(server.url, transport=httpx.HTTPTransport()),
    ):
        client.close()
        with pytest.raises(RuntimeError, match="closed"):
            client.subjects()


@pytest.mark.parametrize(
    ("url", "env", "lean"),
    [
        ("http://127.0.0.1:8931", {}, True),
        ("http://broker.internal/base/", {}, True),
        ("https://broker.internal", {}, False),
        ("http://127.0.0.1:8931", {"HTTP_PROXY": "http://proxy:3128"}, False),
        ("http://127.0.0.1:8931", {"ALL_PROXY": "http://proxy:3128"}, False),
    ],
)
def test_when_the_sdk_uses_its_own_transport(
    url: str, env: dict[str, str], lean: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with BrokerClient(url) as client:
        assert (client._direct is not None) is lean


def test_one_client_many_threads(server: ScriptedServer) -> None:
    pulled: list[list[Message]] = []
    with BrokerClient(server.url, max_connections=2) as client:
        threads = [
            threading.Thread(target=lambda: pulled.append(client.pull("orders", "g", "c")))
            for _ in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert pulled == [[Message.from_wire(dict(DELIVERED))]] * 6
    assert server.connections <= 2
