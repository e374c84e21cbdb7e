"""The hot routes (produce, pull, ack, nack) go around Starlette's layers: the same answers,
guard, metrics and 500 as through them, and everything else still reaches Starlette.

The app over a real in-process broker, called through httpx's ASGI transport; the 500 case
calls ``HotRoutes`` with an endpoint that fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from qmq_broker.engine import Broker
from qmq_broker.http.app import create_app
from qmq_broker.http.guard import GuardPolicy
from qmq_broker.http.hot import HotRoutes
from tests.support.engine import run_broker

JSON = {"content-type": "application/json"}


def requests_counted(broker: Broker, route: str) -> float:
    return (
        broker.metrics.registry.get_sample_value(
            "qmq_broker_request_seconds_count", {"endpoint": route, "status": "200"}
        )
        or 0.0
    )


def test_produce_pull_ack_and_nack_are_served_with_their_metrics(tmp_path: Path) -> None:
    async def script(broker: Broker) -> None:
        app = create_app(broker, guard=GuardPolicy.for_bind("127.0.0.1", allow_origins=()))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            doc = {"messages": [{"id": "m-1", "subject": "orders", "body": "hello"}]}
            produced = await http.post("/v1/messages", json=doc)
            assert produced.status_code == 200
            assert produced.json()["results"][0]["status"] == "stored"
            assert produced.headers["content-type"] == "application/json"
            pull = {"subject": "orders", "group": "g", "consumer": "c", "wait_ms": 0}
            pulled = (await http.post("/v1/pull", json=pull)).json()["messages"]
            assert [m["body"] for m in pulled] == ["hello"]
            ack = {"subject": "orders", "group": "g", "consumer": "c", "seqs": [pulled[0]["seq"]]}
            assert (await http.post("/v1/ack", json=ack)).json()["acked"] == 1
            doc["messages"][0]["id"] = "m-2"
            await http.post("/v1/messages", json=doc)
            again = (await http.post("/v1/pull", json=pull)).json()["messages"]
            nack = {**ack, "seqs": [again[0]["seq"]], "delay_ms": 60_000}
            nacked = await http.post("/v1/nack", json=nack)
            assert nacked.status_code == 200
            assert nacked.json() == {"retrying": 1, "dead": 0}
            for route, count in (("produce", 2), ("pull", 2), ("ack", 1), ("nack", 1)):
                assert requests_counted(broker, route) == count
            # what the hot routes do not take goes on to Starlette: its 405 and 404 as before
            wrong = await http.get("/v1/messages")
            assert wrong.status_code == 405
            assert wrong.json()["error"]["code"] == "method_not_allowed"
            assert (await http.post("/v1/messages/x", json=doc)).status_code == 404
            # the guard and the routes' own checks still come first
            foreign = await http.post("/v1/messages", json=doc, headers={"host": "evil.example"})
            assert foreign.json()["error"]["code"] == "host_not_allowed"
            plain = await http.post(
                "/v1/ack", content=b"{}", headers={"content-type": "text/plain"}
            )
            assert plain.status_code == 415

    run_broker(tmp_path / "data", script)


def test_an_unexpected_failure_is_a_500_naming_no_detail_and_raised_for_the_log() -> None:
    async def failing(request: Request) -> Response:
        raise RuntimeError("a secret detail")

    async def elsewhere(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a hot path must not reach the app behind")

    hot = HotRoutes(
        elsewhere,
        routes={"/v1/ack": failing},
        guard=GuardPolicy.for_bind("127.0.0.1", allow_origins=()),
    )
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/ack",
        "scheme": "http",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
        "query_string": b"",
    }
    with pytest.raises(RuntimeError, match="a secret detail"):
        asyncio.run(hot(scope, receive, send))
    assert sent[0]["status"] == 500
    assert b"internal error; see the broker log" in sent[1]["body"]
    assert b"secret" not in sent[1]["body"]
