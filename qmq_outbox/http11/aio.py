"""``AsyncHttp11Transport``: the asyncio twin of ``sync.Http11Transport``.

Each connection is an ``asyncio.Protocol`` that feeds ``parse.ResponseParser`` (httptools)
from ``data_received`` and resolves one future per exchange: no stream objects, no task per
request. The read timeout runs from the moment the request is handed to the socket. A
cancelled or failed exchange closes its connection (what was left on it is unknown).
asyncio only (the SDK's async side is asyncio throughout).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import cast

import httpx

from qmq_outbox.http11.parse import Origin, Parsed, ProtocolError, RequestHead, ResponseParser
from qmq_outbox.http11.sync import Timeouts, connect_errors, readable, timeouts


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: ResponseParser | None = None
        self._waiter: asyncio.Future[Parsed] | None = None
        self._request: httpx.Request | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # nothing asked: a server talking out of turn
            self.close()
            return
        try:
            parsed = parser.feed(data)
        except ProtocolError as exc:
            self._fail(httpx.RemoteProtocolError(str(exc), request=self._request))
            return
        if parsed is not None:
            self._resolve(parsed)

    def eof_received(self) -> bool:
        parser = self._parser
        if parser is not None:
            try:
                self._resolve(parser.feed_eof())
            except ProtocolError as exc:
                self._fail(httpx.RemoteProtocolError(str(exc), request=self._request))
        self.closed = True
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._parser is not None:
            text = str(exc) if exc else "connection closed before a complete response"
            self._fail(httpx.ReadError(text, request=self._request))

    # -- one exchange -------------------------------------------------------------------

    async def exchange(
        self,
        data: bytes,
        head_only: bool,
        read_timeout: float | None,
        request: httpx.Request | None,
    ) -> Parsed:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Parsed] = loop.create_future()
        self._waiter = waiter
        self._parser = ResponseParser(head_only=head_only)
        self._request = request
        timer = None if read_timeout is None else loop.call_later(read_timeout, self._timed_out)
        try:
            self.transport.write(data)
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._parser = self._waiter = self._request = None
            if not waiter.done() or waiter.cancelled() or waiter.exception() is not None:
                self.close()

    def _timed_out(self) -> None:
        self._fail(httpx.ReadTimeout("timed out", request=self._request))

    def _resolve(self, parsed: Parsed) -> None:
        waiter = self._waiter
        self._parser = None
        if waiter is not None and not waiter.done():
            waiter.set_result(parsed)

    def _fail(self, exc: Exception) -> None:
        waiter = self._waiter
        self._parser = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def usable(self, now: float, expiry: float | None) -> bool:
        """Open, not idle too long, and no end in the socket that the loop has not seen yet
        (a request is often sent in the same loop turn that read the last answer)."""
        if self.closed or (expiry is not None and now - self.idle_since > expiry):
            return False
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        return sock is None or not readable(sock)

    def reusable(self, parsed: Parsed) -> bool:
        """After ``parsed``: open, and none of the request left unsent (an early answer)."""
        transport = self.transport
        return (
            parsed.keep_alive
            and not self.closed
            and transport is not None
            and transport.get_write_buffer_size() == 0
        )

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


@dataclasses.dataclass
class _Pool:
    """What belongs to one event loop: its connections and its limit on them."""

    loop: asyncio.AbstractEventLoop
    slots: asyncio.Semaphore | None
    idle: dict[Origin, list[_Connection]] = dataclasses.field(default_factory=dict)


class AsyncHttp11Transport(httpx.AsyncBaseTransport):
    """asyncio HTTP/1.1 over a pool of keep-alive connections (``http://`` only)."""

    def __init__(self, *, limits: httpx.Limits = httpx.Limits()) -> None:
        self._max = limits.max_connections
        self._keep = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._pool: _Pool | None = None
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return (await self.exchange(request)).response()

    async def exchange(self, request: httpx.Request) -> Parsed:
        """``request``'s answer, not yet an ``httpx.Response``."""
        head = RequestHead.of(request)
        return await self.send(head, await request.aread(), timeouts(request), request=request)

    async def send(
        self,
        head: RequestHead,
        body: bytes,
        limits: Timeouts,
        *,
        request: httpx.Request | None = None,
    ) -> Parsed:
        """The answer to ``head`` with ``body`` (see ``Http11Transport.send``)."""
        data = head.request(body)
        pool = self._current_pool()
        slots = pool.slots
        if slots is not None:
            await self._acquire(slots, limits.get("pool"), request)
        try:
            where = head.origin
            connection = self._checkout(pool, where) or await self._connect(where, limits, request)
            read = limits.get("read")
            try:
                parsed = await connection.exchange(data, head.method == "HEAD", read, request)
            except OSError as exc:
                raise httpx.WriteError(str(exc), request=request) from exc
            if connection.reusable(parsed):
                self._checkin(pool, where, connection)
            else:
                connection.close()
        finally:
            if slots is not None:
                slots.release()
        return parsed

    async def aclose(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            _drop(pool)

    def _current_pool(self) -> _Pool:
        """This loop's pool; a client used from a new event loop starts afresh (the old
        loop's connections cannot be used from this one)."""
        loop = asyncio.get_running_loop()
        pool = self._pool
        if pool is None or pool.loop is not loop:
            if pool is not None:
                _drop(pool)
            slots = None if self._max is None else asyncio.Semaphore(self._max)
            pool = self._pool = _Pool(loop, slots)
        return pool

    @staticmethod
    async def _acquire(
        slots: asyncio.Semaphore, wait: float | None, request: httpx.Request | None
    ) -> None:
        if not slots.locked():
            await slots.acquire()  # free: returns at once
            return
        try:
            await asyncio.wait_for(slots.acquire(), wait)
        except TimeoutError as exc:
            raise httpx.PoolTimeout("no free connection", request=request) from exc

    def _checkout(self, pool: _Pool, where: Origin) -> _Connection | None:
        idle = pool.idle.get(where)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable(now, self._expiry):
                return connection
            connection.close()
        return None

    def _checkin(self, pool: _Pool, where: Origin, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        idle = pool.idle.setdefault(where, [])
        if (
            self._closed
            or pool is not self._pool
            or (self._keep is not None and len(idle) >= self._keep)
        ):
            connection.close()
        else:
            idle.append(connection)

    async def _connect(
        self, where: Origin, limits: Timeouts, request: httpx.Request | None
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        with connect_errors(request):
            _, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, *where), limits.get("connect")
            )
        return connection


def _drop(pool: _Pool) -> None:
    """Close ``pool``'s idle connections (best effort when their loop is closed already)."""
    idle, pool.idle = pool.idle, {}
    for connections in idle.values():
        for connection in connections:
            with contextlib.suppress(RuntimeError):  # "Event loop is closed"
                connection.close()
