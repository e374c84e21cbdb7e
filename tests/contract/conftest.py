"""One suite, two brokers: each contract test runs against ``InMemoryBroker`` and a real one.

Every answer either gives is validated against the broker's answer models
(``qmq_broker.http.answers``) when the test ends, so the fake, the real broker and the OpenAPI
document cannot drift apart unnoticed.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pydantic import BaseModel

from qmq_broker.http import answers
from qmq_broker.messages import pulled_fields
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.testing import BASE_URL, InMemoryBroker, StepClock
from qmq_wire.ordered import split_partition_log
from qmq_wire.records import is_records_answer, read_records_answer
from tests.support.broker_process import BrokerProcess

ACK_TIMEOUT_S = 1.0
MAX_ATTEMPTS = 2
MAX_BODY = 2048
_NAMES = itertools.count()

_ANSWER_MODELS: list[tuple[str, re.Pattern[str], type[BaseModel]]] = [
    ("POST", re.compile(r"/v1/messages"), answers.ProduceResponse),
    ("POST", re.compile(r"/v1/pull"), answers.PullResponse),
    ("POST", re.compile(r"/v1/ack"), answers.AckResponse),
    ("POST", re.compile(r"/v1/nack"), answers.NackResponse),
    ("GET", re.compile(r"/v1/subjects"), answers.SubjectsResponse),
    ("GET", re.compile(r"/v1/subjects/[^/]+"), answers.SubjectResponse),
    ("GET", re.compile(r"/v1/subjects/[^/]+/groups/[^/]+/dead"), answers.DeadLettersResponse),
    ("POST", re.compile(r"/v1/subjects/[^/]+/groups/[^/]+/dead/redrive"), answers.RedriveResponse),
    ("POST", re.compile(r"/v1/subjects/[^/]+/groups/[^/]+/reset"), answers.ResetResponse),
    ("PUT", re.compile(r"/v1/subjects/[^/]+"), answers.RoutesResponse),
    ("GET", re.compile(r"/v1/subjects/[^/]+/routes"), answers.RoutesResponse),
    (
        "POST",
        re.compile(r"/v1/subjects/[^/]+/partitions/(split|merge|move)"),
        answers.RoutesResponse,
    ),
    ("GET", re.compile(r"/healthz"), answers.HealthResponse),
]


def answer_model(method: str, path: str, status: int) -> type[BaseModel]:
    """The model an answer must match: the route's on 200, the error answer otherwise."""
    for route_method, pattern, model in _ANSWER_MODELS:
        matches = route_method == method and pattern.fullmatch(path) is not None
        if matches and (status == 200 or model is answers.HealthResponse):
            return model
    return answers.ErrorResponse


@dataclass
class Answers:
    """Answers seen by a target's clients: (method, path, status, body)."""

    seen: list[tuple[str, str, int, bytes]] = field(default_factory=list)

    def record(self, request: httpx.Request, response: httpx.Response) -> None:
        self.seen.append((request.method, request.url.path, response.status_code, response.content))

    def check(self) -> None:
        for method, path, status, body in self.seen:
            answer_model(method, path, status).model_validate_json(_as_json(body))


def _as_json(body: bytes) -> bytes:
    """A records answer (what the SDK's pulls ask for) as the JSON answer it stands for."""
    if not is_records_answer(body):
        return body
    doc, entries = read_records_answer(body, orjson.loads)
    messages = []
    for attempt, partition, fields in entries:
        message: dict[str, Any] = dict(pulled_fields(fields, attempt=attempt))
        if partition is not None:
            message["subject"], message["partition"] = split_partition_log(fields[5])
        messages.append(message)
    return orjson.dumps({**doc, "messages": messages})


class _Recording(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, answers_: Answers) -> None:
        self._inner = inner
        self._answers = answers_

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        response.read()
        self._answers.record(request, response)
        return response

    def close(self) -> None:
        self._inner.close()


class _AsyncRecording(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, answers_: Answers) -> None:
        self._inner = inner
        self._answers = answers_

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        await response.aread()
        self._answers.record(request, response)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class Target:
    """A broker under contract: its clients and a way to let time pass."""

    kind: str  # "fake" | "broker"
    base_url: str
    client: BrokerClient
    http: httpx.Client
    make_async_client: Callable[[], AsyncBrokerClient]
    advance: Callable[[float], None]
    answers: Answers

    def subject(self, name: str = "orders") -> str:
        """A subject no other test uses (one real broker serves the whole suite)."""
        return f"{name}.{next(_NAMES)}"

    def post(self, path: str, doc: Any) -> httpx.Response:
        return self.http.post(path, content=orjson.dumps(doc))


@pytest.fixture(scope="session")
def real_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    data_dir: Path = tmp_path_factory.mktemp("contract") / "data"
    process = BrokerProcess(
        data_dir,
        extra_args=[
            "--ack-timeout",
            f"{ACK_TIMEOUT_S:g}s",
            "--max-attempts",
            str(MAX_ATTEMPTS),
            "--max-body-size",
            str(MAX_BODY),
        ],
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(params=["fake", "broker"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    seen = Answers()
    headers = {"content-type": "application/json"}
    if request.param == "fake":
        clock = StepClock()
        fake = InMemoryBroker(
            ack_timeout=ACK_TIMEOUT_S, max_attempts=MAX_ATTEMPTS, max_body=MAX_BODY, clock=clock
        )
        base_url = BASE_URL
        transport: httpx.BaseTransport = fake.transport()
        make_async: Callable[[], httpx.AsyncBaseTransport] = fake.async_transport
        advance: Callable[[float], None] = clock.advance
    else:
        base_url = request.getfixturevalue("real_broker").url
        transport = httpx.HTTPTransport()
        make_async = httpx.AsyncHTTPTransport
        advance = time.sleep
    client = BrokerClient(base_url, transport=_Recording(transport, seen))
    http = httpx.Client(
        base_url=base_url, headers=headers, transport=_Recording(transport, seen), timeout=10
    )

    def make_async_client() -> AsyncBrokerClient:
        return AsyncBrokerClient(base_url, transport=_AsyncRecording(make_async(), seen))

    yield Target(request.param, base_url, client, http, make_async_client, advance, seen)
    client.close()
    http.close()
    seen.check()
