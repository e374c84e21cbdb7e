"""HTTP client for the broker's API v1: a sync ``BrokerClient`` and an ``AsyncBrokerClient``.

Each API call is described once, in ``qmq_outbox.calls`` (method, path, body, how to read
the answer); the two clients only send it, blocking or awaited. Transport errors, 429 and
5xx become ``BrokerUnavailable`` (retry later), other 4xx ``BrokerRejected`` (permanent).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Generic, ParamSpec, TypeVar, overload

import httpx

from qmq_outbox import calls, http11
from qmq_outbox.calls import DEFAULT_TIMEOUT, Call
from qmq_outbox.errors import BrokerUnavailable

_JSON = {"content-type": "application/json"}
_KNOWN_HEADS = 64  # request heads a client keeps: the API's fixed paths and a few others
_KNOWN_TIMEOUTS = 16  # per-call timeouts a client keeps converted: a consumer's long polls

P = ParamSpec("P")
T = TypeVar("T")


def _unreachable(exc: httpx.HTTPError) -> BrokerUnavailable:
    return BrokerUnavailable(f"broker unreachable: {exc!r}")


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
        return self if client is None else client.bound(self.build)


HttpClient = TypeVar("HttpClient", httpx.Client, httpx.AsyncClient)
Transport = TypeVar("Transport", httpx.BaseTransport, httpx.AsyncBaseTransport)
Lean = TypeVar("Lean", http11.Http11Transport, http11.AsyncHttp11Transport)


class _Client(Generic[HttpClient, Transport, Lean]):
    """What both clients share: their settings and their methods, one per API call.

    Given no ``transport``, a client for a plain ``http://`` broker (and no proxy in the
    environment) uses the SDK's own transport (``qmq_outbox.http11``) and sends to it
    directly: httpx.Client's per-request work (building and encoding a Request, auth flows,
    redirects, cookie jar, event hooks, request logging, building a Response) cost more CPU
    than the exchange itself, and none of it serves the broker's API. The request head of
    each path is still made by the ``httpx.Client`` (base URL, default and auth headers),
    once, and kept. An injected transport gets the whole ``httpx.Client`` path, as before.
    """

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
        self._direct: Lean | None = None  # the SDK's own transport, when it is used
        if transport is None and http11.fits(base_url):
            self._direct = self._lean(limits)
        self._http: HttpClient = self._open(
            base_url=base_url,
            headers=headers,
            timeout=timeout,
            limits=limits,
            transport=transport or self._direct,
        )
        self._timeouts = httpx.Timeout(timeout).as_dict()
        self._call_timeouts: dict[float, http11.Timeouts] = {}  # a long poll's, per value
        self._heads: dict[
            tuple[str, str, str, tuple[tuple[str, str], ...]], http11.RequestHead
        ] = {}
        self._methods: dict[Callable[..., Any], Callable[..., Any]] = {}

    def bound(self, build: Callable[..., Any]) -> Callable[..., Any]:
        """``build``'s call as a method of this client (``bind``), made once per client:
        the consumer calls ``pull`` and ``ack`` for every few messages."""
        method = self._methods.get(build)
        if method is None:
            method = self._methods[build] = self.bind(build)
        return method

    def bind(self, build: Callable[P, Call[T]]) -> Callable[P, Any]:
        """``build``'s call as a method of this client: blocking or a coroutine function,
        as each client class defines it."""
        raise NotImplementedError

    def _head(self, call: Call[Any]) -> http11.RequestHead:
        """``call``'s request head as ``httpx.Client.build_request`` makes it (base URL, the
        client's headers), built once per method and path (and query) for the direct path."""
        params, headers = call.params, call.headers
        query = "" if not params else repr(sorted(params.items()))
        key = (call.method, call.path, query, headers)
        head = self._heads.get(key)
        if head is None:
            request = self._http.build_request(
                call.method, call.path, params=params, headers=dict(headers)
            )
            head = http11.RequestHead.of(request)
            if len(self._heads) < _KNOWN_HEADS:
                self._heads[key] = head
        return head

    def _limits(self, call: Call[Any]) -> http11.Timeouts:
        if call.timeout is None:
            return self._timeouts
        found = self._call_timeouts.get(call.timeout)
        if found is None:
            found = httpx.Timeout(call.timeout).as_dict()
            if len(self._call_timeouts) < _KNOWN_TIMEOUTS:
                self._call_timeouts[call.timeout] = found
        return found

    @property
    def base_url(self) -> str:
        """The broker's base URL, as given (for log lines and errors)."""
        return str(self._http.base_url).rstrip("/")

    def _open(self, **settings: Any) -> HttpClient:
        raise NotImplementedError

    def _lean(self, limits: httpx.Limits) -> Lean:
        """The default transport for a plain ``http://`` broker (see ``qmq_outbox.http11``)."""
        raise NotImplementedError

    produce = _Endpoint(calls.produce)
    produce_raw = _Endpoint(calls.produce_raw)
    pull = _Endpoint(calls.pull)
    ack = _Endpoint(calls.ack)
    ack_and_pull = _Endpoint(calls.ack_and_pull)
    nack = _Endpoint(calls.nack)
    subjects = _Endpoint(calls.subjects)
    subject = _Endpoint(calls.subject)
    dead_letters = _Endpoint(calls.dead_letters)
    redrive = _Endpoint(calls.redrive)
    reset_group = _Endpoint(calls.reset_group)
    declare_subject = _Endpoint(calls.declare_subject)
    routes = _Endpoint(calls.routes)
    split_partition = _Endpoint(calls.split_partition)
    merge_partitions = _Endpoint(calls.merge_partitions)
    move_partition = _Endpoint(calls.move_partition)


class BrokerClient(_Client[httpx.Client, httpx.BaseTransport, http11.Http11Transport]):
    """Blocking client. Thread-safe (one pooled ``httpx.Client``)."""

    def _open(self, **settings: Any) -> httpx.Client:
        return httpx.Client(**settings)

    def _lean(self, limits: httpx.Limits) -> http11.Http11Transport:
        return http11.Http11Transport(limits=limits)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, call: Call[T]) -> T:
        http, direct = self._http, self._direct
        try:
            if direct is None or http.is_closed:
                response = http.send(call.request(http))
                status, content = response.status_code, response.content
            else:  # see _Client
                parsed = direct.send(self._head(call), call.content or b"", self._limits(call))
                status, content = http11.answer(parsed)
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc
        return call.answer_body(status, content)

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


class AsyncBrokerClient(
    _Client[httpx.AsyncClient, httpx.AsyncBaseTransport, http11.AsyncHttp11Transport]
):
    """asyncio client with the same calls as ``BrokerClient``."""

    def _open(self, **settings: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(**settings)

    def _lean(self, limits: httpx.Limits) -> http11.AsyncHttp11Transport:
        return http11.AsyncHttp11Transport(limits=limits)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def send(self, call: Call[T]) -> T:
        http, direct = self._http, self._direct
        try:
            if direct is None or http.is_closed:
                response = await http.send(call.request(http))
                status, content = response.status_code, response.content
            else:  # see _Client
                head, limits = self._head(call), self._limits(call)
                parsed = await direct.send(head, call.content or b"", limits)
                status, content = http11.answer(parsed)
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc
        return call.answer_body(status, content)

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
