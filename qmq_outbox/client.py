"""HTTP client for the broker's API v1: a sync ``BrokerClient`` and an ``AsyncBrokerClient``.

Both shells share request building and response parsing; transport errors, 429 and 5xx
become ``BrokerUnavailable`` (retry later), other 4xx ``BrokerRejected`` (permanent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import httpx
import orjson

from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable
from qmq_wire import transient

PullMode = Literal["shared", "broadcast"]
StartAt = Literal["earliest", "latest"]
DEFAULT_TIMEOUT = 10.0
_JSON = {"content-type": "application/json"}


def _headers(token: str | None) -> dict[str, str]:
    headers = dict(_JSON)
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def _check(response: httpx.Response) -> Any:
    if response.status_code == 200:
        return orjson.loads(response.content)
    try:
        error = orjson.loads(response.content)["error"]
        code, message, field = error["code"], error["message"], error.get("field")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        code, message, field = "http_error", response.text[:200], None
    if transient(response.status_code):
        raise BrokerUnavailable(f"broker answered {response.status_code} {code}: {message}")
    raise BrokerRejected(status=response.status_code, code=code, message=message, field=field)


def _pull_body(
    subject: str,
    group: str,
    consumer: str,
    max_messages: int,
    wait_ms: int,
    mode: PullMode,
    start: StartAt,
) -> bytes:
    return orjson.dumps(
        {
            "subject": subject,
            "group": group,
            "consumer": consumer,
            "max": max_messages,
            "wait_ms": wait_ms,
            "mode": mode,
            "start": start,
        }
    )


def _produce_results(doc: Any) -> list[ProduceResult]:
    return [
        ProduceResult(id=r["id"], subject=r["subject"], status=r["status"], seq=r.get("seq"))
        for r in doc["results"]
    ]


def _seqs_body(subject: str, group: str, consumer: str, seqs: Sequence[int]) -> dict[str, Any]:
    return {"subject": subject, "group": group, "consumer": consumer, "seqs": list(seqs)}


class BrokerClient:
    """Blocking client. Thread-safe (one pooled ``httpx.Client``)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 16,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url,
            headers=_headers(token),
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, content: bytes, *, timeout: float | None = None) -> Any:
        try:
            extra = {} if timeout is None else {"timeout": timeout}
            response = self._http.post(path, content=content, **extra)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc!r}") from exc
        return _check(response)

    def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.get(path, params=params)
        except httpx.HTTPError as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc!r}") from exc
        return _check(response)

    def produce(self, messages: Sequence[OutgoingMessage]) -> list[ProduceResult]:
        """Store a batch (1..1000); returns one result per message in request order."""
        body = orjson.dumps({"messages": [m.to_wire() for m in messages]})
        return _produce_results(self._post("/v1/messages", body))

    def pull(
        self,
        subject: str,
        group: str,
        consumer: str,
        *,
        max_messages: int = 32,
        wait_ms: int = 0,
        mode: PullMode = "shared",
        start: StartAt = "earliest",
    ) -> list[Message]:
        body = _pull_body(subject, group, consumer, max_messages, wait_ms, mode, start)
        doc = self._post("/v1/pull", body, timeout=DEFAULT_TIMEOUT + wait_ms / 1000)
        return [Message.from_wire(m) for m in doc["messages"]]

    def ack(self, subject: str, group: str, consumer: str, seqs: Sequence[int]) -> dict[str, Any]:
        doc: dict[str, Any] = self._post(
            "/v1/ack", orjson.dumps(_seqs_body(subject, group, consumer, seqs))
        )
        return doc

    def nack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        delay_ms: int | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        payload = _seqs_body(subject, group, consumer, seqs)
        payload.update(delay_ms=delay_ms, error=error)
        doc: dict[str, Any] = self._post("/v1/nack", orjson.dumps(payload))
        return doc

    def subjects(self) -> list[dict[str, Any]]:
        subjects: list[dict[str, Any]] = self._get("/v1/subjects")["subjects"]
        return subjects

    def subject(self, subject: str) -> dict[str, Any]:
        doc: dict[str, Any] = self._get(f"/v1/subjects/{subject}")
        return doc

    def dead_letters(
        self, subject: str, group: str, *, limit: int = 100, after_seq: int | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after_seq is not None:
            params["after_seq"] = after_seq
        doc: dict[str, Any] = self._get(f"/v1/subjects/{subject}/groups/{group}/dead", params)
        return doc

    def redrive(self, subject: str, group: str, seqs: Sequence[int] | None = None) -> int:
        payload: dict[str, Any] = {"all": True} if seqs is None else {"seqs": list(seqs)}
        path = f"/v1/subjects/{subject}/groups/{group}/dead/redrive"
        return int(self._post(path, orjson.dumps(payload))["redriven"])

    def healthy(self) -> bool:
        try:
            return self._http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False


class AsyncBrokerClient:
    """asyncio client with the same calls as ``BrokerClient``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 16,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers=_headers(token),
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, path: str, content: bytes, *, seconds: float | None = None) -> Any:
        try:
            extra = {} if seconds is None else {"timeout": seconds}
            response = await self._http.post(path, content=content, **extra)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc!r}") from exc
        return _check(response)

    async def produce(self, messages: Sequence[OutgoingMessage]) -> list[ProduceResult]:
        body = orjson.dumps({"messages": [m.to_wire() for m in messages]})
        return _produce_results(await self._post("/v1/messages", body))

    async def produce_raw(self, body: bytes) -> list[ProduceResult]:
        """Send an already-encoded ``{"messages": [...]}`` document (load generators)."""
        return _produce_results(await self._post("/v1/messages", body))

    async def pull(
        self,
        subject: str,
        group: str,
        consumer: str,
        *,
        max_messages: int = 32,
        wait_ms: int = 0,
        mode: PullMode = "shared",
        start: StartAt = "earliest",
    ) -> list[Message]:
        body = _pull_body(subject, group, consumer, max_messages, wait_ms, mode, start)
        doc = await self._post("/v1/pull", body, seconds=DEFAULT_TIMEOUT + wait_ms / 1000)
        return [Message.from_wire(m) for m in doc["messages"]]

    async def ack(
        self, subject: str, group: str, consumer: str, seqs: Sequence[int]
    ) -> dict[str, Any]:
        doc: dict[str, Any] = await self._post(
            "/v1/ack", orjson.dumps(_seqs_body(subject, group, consumer, seqs))
        )
        return doc

    async def nack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        delay_ms: int | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        payload = _seqs_body(subject, group, consumer, seqs)
        payload.update(delay_ms=delay_ms, error=error)
        doc: dict[str, Any] = await self._post("/v1/nack", orjson.dumps(payload))
        return doc
