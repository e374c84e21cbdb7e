"""An in-memory stand-in for the broker's produce API, as an ``httpx`` transport.

Dedups by (subject, id) like the real broker, stores nothing from a rejected batch, and can
be switched to answer 503 (unavailable) or to reject chosen subjects/bodies (400/413).
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from typing import Any

import httpx
import orjson

from qmq_outbox.client import AsyncBrokerClient, BrokerClient

_SUBJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class FakeBroker:
    def __init__(self, *, max_body: int = 1024 * 1024) -> None:
        self.max_body = max_body
        self.available = True
        self.lose_responses = 0  # store, then fail the response this many times
        self.requests = 0
        self.stored: list[dict[str, Any]] = []
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def ids(self) -> Counter[str]:
        return Counter(m["id"] for m in self.stored)

    def _error(self, status: int, code: str, field: str) -> httpx.Response:
        body = {"error": {"code": code, "message": code, "field": field}}
        return httpx.Response(status, content=orjson.dumps(body))

    def handle(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests += 1
            if not self.available:
                return self._error(503, "unavailable", "")
            assert request.url.path == "/v1/messages", request.url.path
            messages = orjson.loads(request.content)["messages"]
            for i, m in enumerate(messages):
                if not _SUBJECT.match(m["subject"]):
                    return self._error(400, "invalid_subject", f"messages[{i}].subject")
                if len(m["body"]) > self.max_body:
                    return self._error(413, "body_too_large", f"messages[{i}].body")
            results = []
            for m in messages:
                key = (m["subject"], m["id"])
                status = "duplicate" if key in self._seen else "stored"
                if status == "stored":
                    self._seen.add(key)
                    self.stored.append(m)
                results.append({"id": m["id"], "subject": m["subject"], "status": status, "seq": 0})
            if self.lose_responses:
                self.lose_responses -= 1
                raise httpx.ReadTimeout("response lost", request=request)
            return httpx.Response(200, content=orjson.dumps({"results": results}))

    async def handle_async(self, request: httpx.Request) -> httpx.Response:
        return self.handle(request)

    def client(self) -> BrokerClient:
        return BrokerClient("http://fake", transport=httpx.MockTransport(self.handle))

    def async_client(self) -> AsyncBrokerClient:
        return AsyncBrokerClient("http://fake", transport=httpx.MockTransport(self.handle_async))
