"""HTTP client for the broker's API v1: a sync ``BrokerClient`` and an ``AsyncBrokerClient``.

Each API call is described once, as a ``Call`` (method, path, body, how to read the answer);
the two clients only send it, blocking or awaited. Transport errors, 429 and 5xx become
``BrokerUnavailable`` (retry later), other 4xx ``BrokerRejected`` (permanent).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

import httpx
import orjson

import qmq_wire
from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable

PullMode = Literal["shared", "broadcast"]
StartAt = Literal["earliest", "latest"]
DEFAULT_TIMEOUT = 10.0
_JSON = {"content-type": "application/json"}

P = ParamSpec("P")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Call(Generic[T]):
    """One request of the API and how to read its answer."""

    method: Literal["GET", "POST"]
    path: str
    read: Callable[[Any], T]
    content: bytes | None = None
    params: dict[str, Any] | None = None
    timeout: float | None = None  # None: the client's

    def request(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        timeout = httpx.USE_CLIENT_DEFAULT if self.timeout is None else self.timeout
        return http.build_request(
            self.method, self.path, content=self.content, params=self.params, timeout=timeout
        )

    def answer(self, response: httpx.Response) -> T:
        return self.read(_check(response))


def _check(response: httpx.Response) -> Any:
    if response.status_code == 200:
        return orjson.loads(response.content)
    try:
        error = orjson.loads(response.content)["error"]
        code, message, field = error["code"], error["message"], error.get("field")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        code, message, field = "http_error", response.text[:200], None
    if qmq_wire.transient(response.status_code):
        raise BrokerUnavailable(f"broker answered {response.status_code} {code}: {message}")
    raise BrokerRejected(status=response.status_code, code=code, message=message, field=field)


def _unreachable(exc: httpx.HTTPError) -> BrokerUnavailable:
    return BrokerUnavailable(f"broker unreachable: {exc!r}")


# -- the calls ----------------------------------------------------------------------------------


def _as_dict(doc: Any) -> dict[str, Any]:
    result: dict[str, Any] = doc
    return result


def _produce_results(doc: Any) -> list[ProduceResult]:
    return [
        ProduceResult(id=r["id"], subject=r["subject"], status=r["status"], seq=r.get("seq"))
        for r in doc["results"]
    ]


def _post(path: str, doc: Any, read: Callable[[Any], T], **options: Any) -> Call[T]:
    return Call(method="POST", path=path, read=read, content=orjson.dumps(doc), **options)


def _seqs(subject: str, group: str, consumer: str, seqs: Sequence[int]) -> dict[str, Any]:
    return {"subject": subject, "group": group, "consumer": consumer, "seqs": list(seqs)}


def produce(messages: Sequence[OutgoingMessage]) -> Call[list[ProduceResult]]:
    """Store a batch (1..1000); returns one result per message in request order."""
    doc = {"messages": [m.to_wire() for m in messages]}
    return _post("/v1/messages", doc, _produce_results)


def produce_raw(body: bytes) -> Call[list[ProduceResult]]:
    """Send an already-encoded ``{"messages": [...]}`` document (load generators)."""
    return Call(method="POST", path="/v1/messages", read=_produce_results, content=body)


def pull(
    subject: str,
    group: str,
    consumer: str,
    *,
    max_messages: int = 32,
    wait_ms: int = 0,
    mode: PullMode = "shared",
    start: StartAt = "earliest",
) -> Call[list[Message]]:
    """Lease up to ``max_messages`` of ``subject`` for ``group``, long-polling ``wait_ms``."""
    doc = {
        "subject": subject,
        "group": group,
        "consumer": consumer,
        "max": max_messages,
        "wait_ms": wait_ms,
        "mode": mode,
        "start": start,
    }
    timeout = DEFAULT_TIMEOUT + wait_ms / 1000
    return _post("/v1/pull", doc, _messages, timeout=timeout)


def _messages(doc: Any) -> list[Message]:
    return [Message.from_wire(m) for m in doc["messages"]]


def ack(subject: str, group: str, consumer: str, seqs: Sequence[int]) -> Call[dict[str, Any]]:
    """Ack leased messages: ``{"acked": n, "unknown": [seqs not leased to us]}``."""
    return _post("/v1/ack", _seqs(subject, group, consumer, seqs), _as_dict)


def nack(
    subject: str,
    group: str,
    consumer: str,
    seqs: Sequence[int],
    *,
    delay_ms: int | None = None,
    error: str | None = None,
) -> Call[dict[str, Any]]:
    """Give leased messages back for a retry after ``delay_ms`` (None: the broker's backoff)."""
    doc = _seqs(subject, group, consumer, seqs) | {"delay_ms": delay_ms, "error": error}
    return _post("/v1/nack", doc, _as_dict)


def subjects() -> Call[list[dict[str, Any]]]:
    """Every subject with its counters."""
    return Call(method="GET", path="/v1/subjects", read=lambda doc: list(doc["subjects"]))


def subject(subject: str) -> Call[dict[str, Any]]:
    """One subject with its groups."""
    return Call(method="GET", path=f"/v1/subjects/{subject}", read=_as_dict)


def dead_letters(
    subject: str, group: str, *, limit: int = 100, after_seq: int | None = None
) -> Call[dict[str, Any]]:
    """A page of the group's dead letters, oldest first."""
    params: dict[str, Any] = {"limit": limit}
    if after_seq is not None:
        params["after_seq"] = after_seq
    path = f"/v1/subjects/{subject}/groups/{group}/dead"
    return Call(method="GET", path=path, read=_as_dict, params=params)


def redrive(subject: str, group: str, seqs: Sequence[int] | None = None) -> Call[int]:
    """Put dead letters back (all of them when ``seqs`` is None); returns how many."""
    doc: dict[str, Any] = {"all": True} if seqs is None else {"seqs": list(seqs)}
    path = f"/v1/subjects/{subject}/groups/{group}/dead/redrive"
    return _post(path, doc, lambda answer: int(answer["redriven"]))


# -- the two clients ----------------------------------------------------------------------------


class _Endpoint(Generic[P, T]):
    """One call of the API as a method of both clients: on a ``BrokerClient`` it blocks and
    returns the answer, on an ``AsyncBrokerClient`` it is a coroutine function."""

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type) -> _Endpoint[P, T]: ...

    @overload
    def __get__(self, client: BrokerClient, owner: type) -> Callable[P, T]: ...

    @overload
    def __get__(
        self, client: AsyncBrokerClient, owner: type
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, client: Any, owner: type) -> Any:
        return self if client is None else client.bind(self.build)


HttpClient = TypeVar("HttpClient", httpx.Client, httpx.AsyncClient)
Transport = TypeVar("Transport", httpx.BaseTransport, httpx.AsyncBaseTransport)


class _Client(Generic[HttpClient, Transport]):
    """What both clients share: their settings and their methods, one per API call."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 16,
        transport: Transport | None = None,
    ) -> None:
        headers = dict(_JSON)
        if token:
            headers["authorization"] = f"Bearer {token}"
        limits = httpx.Limits(max_connections=max_connections)
        self._http: HttpClient = self._open(
            base_url=base_url, headers=headers, timeout=timeout, limits=limits, transport=transport
        )

    def _open(self, **settings: Any) -> HttpClient:
        raise NotImplementedError

    produce = _Endpoint(produce)
    produce_raw = _Endpoint(produce_raw)
    pull = _Endpoint(pull)
    ack = _Endpoint(ack)
    nack = _Endpoint(nack)
    subjects = _Endpoint(subjects)
    subject = _Endpoint(subject)
    dead_letters = _Endpoint(dead_letters)
    redrive = _Endpoint(redrive)


class BrokerClient(_Client[httpx.Client, httpx.BaseTransport]):
    """Blocking client. Thread-safe (one pooled ``httpx.Client``)."""

    def _open(self, **settings: Any) -> httpx.Client:
        return httpx.Client(**settings)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, call: Call[T]) -> T:
        try:
            response = self._http.send(call.request(self._http))
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc
        return call.answer(response)

    def bind(self, build: Callable[P, Call[T]]) -> Callable[P, T]:
        """``build``'s call as a method of this client."""

        @functools.wraps(build)
        def method(*args: P.args, **kwargs: P.kwargs) -> T:
            return self.send(build(*args, **kwargs))

        return method

    def healthy(self) -> bool:
        try:
            return self._http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False


class AsyncBrokerClient(_Client[httpx.AsyncClient, httpx.AsyncBaseTransport]):
    """asyncio client with the same calls as ``BrokerClient``."""

    def _open(self, **settings: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(**settings)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def send(self, call: Call[T]) -> T:
        try:
            response = await self._http.send(call.request(self._http))
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc
        return call.answer(response)

    def bind(self, build: Callable[P, Call[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        """``build``'s call as a coroutine method of this client."""

        @functools.wraps(build)
        async def method(*args: P.args, **kwargs: P.kwargs) -> T:
            return await self.send(build(*args, **kwargs))

        return method

    async def healthy(self) -> bool:
        try:
            return (await self._http.get("/healthz")).status_code == 200
        except httpx.HTTPError:
            return False
