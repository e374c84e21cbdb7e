"""``Http11Transport``: a blocking httpx transport for plain HTTP/1.1 to the broker.

It does what httpx's default transport does for the SDK (a pool of keep-alive connections
of at most ``max_connections``, connect/read/write/pool timeouts, httpx's exceptions) for a
fraction of its CPU per request: one ``sendall`` and a few ``recv_into`` per exchange, the
response parsed by ``parse.ResponseParser`` (httptools). Thread-safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from qmq_outbox.http11.parse import Origin, Parsed, ProtocolError, RequestHead, ResponseParser

RECV_SIZE = 128 * 1024  # a pull of 100 messages of 1 KiB reads in two
Timeouts = dict[str, float | None]  # httpx's "timeout" extension: connect, read, write, pool


_poll = getattr(select, "poll", None)  # not on Windows


def readable(sock: Any) -> bool:
    """Whether an idle connection has something to read: the end of it (the server closes
    idle connections) or bytes nobody asked for. Either way it cannot carry a request."""
    if _poll is None:
        return bool(select.select([sock], [], [], 0)[0])
    poll = _poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


def timeouts(request: httpx.Request) -> Timeouts:
    found: Timeouts = request.extensions.get("timeout", {})
    return found


@contextlib.contextmanager
def connect_errors(request: httpx.Request | None) -> Iterator[None]:
    """Opening a connection: its timeout and OS errors as httpx's ``ConnectTimeout`` and
    ``ConnectError``."""
    try:
        yield
    except TimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc), request=request) from exc
    except OSError as exc:
        raise httpx.ConnectError(str(exc), request=request) from exc


def _timeout(sock: socket.socket, seconds: float | None) -> None:
    if sock.gettimeout() != seconds:  # each settimeout() is a system call
        sock.settimeout(seconds)


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle_since = 0.0
        self.scratch = bytearray(RECV_SIZE)  # recv_into: no allocation per read

    def usable(self, now: float, expiry: float | None) -> bool:
        return (expiry is None or now - self.idle_since <= expiry) and not readable(self.sock)

    def exchange(
        self, data: bytes, head_only: bool, limits: Timeouts, request: httpx.Request | None
    ) -> Parsed:
        """Send ``data``, read the answer."""
        sock = self.sock
        parser = ResponseParser(head_only=head_only)
        write_error: OSError | None = None
        try:
            _timeout(sock, limits.get("write"))
            sock.sendall(data)
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc), request=request) from exc
        except OSError as exc:
            write_error = exc  # the server may have answered early (413) and closed
        _timeout(sock, limits.get("read"))
        try:
            scratch = memoryview(self.scratch)
            while True:
                size = sock.recv_into(scratch)
                parsed = parser.feed(scratch[:size]) if size else parser.feed_eof()
                if parsed is not None:
                    if write_error is not None:  # answered early: the rest of ours is unread
                        return dataclasses.replace(parsed, keep_alive=False)
                    return parsed
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc), request=request) from exc
        except ProtocolError as exc:
            if write_error is not None and not parser.started:
                raise httpx.WriteError(str(write_error), request=request) from write_error
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except OSError as exc:
            if write_error is not None:
                raise httpx.WriteError(str(write_error), request=request) from write_error
            raise httpx.ReadError(str(exc), request=request) from exc

    def close(self) -> None:
        self.sock.close()


class Http11Transport(httpx.BaseTransport):
    """Blocking HTTP/1.1 over a pool of keep-alive connections (``http://`` only)."""

    def __init__(self, *, limits: httpx.Limits = httpx.Limits()) -> None:
        self._slots = (
            threading.BoundedSemaphore(limits.max_connections)
            if limits.max_connections is not None
            else None
        )
        self._keep = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._idle: dict[Origin, list[_Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.exchange(request).response()

    def exchange(self, request: httpx.Request) -> Parsed:
        """``request``'s answer, not yet an ``httpx.Response``."""
        head = RequestHead.of(request)
        return self.send(head, request.read(), timeouts(request), request=request)

    def send(
        self,
        head: RequestHead,
        body: bytes,
        limits: Timeouts,
        *,
        request: httpx.Request | None = None,
    ) -> Parsed:
        """The answer to ``head`` with ``body``: what the SDK's client calls, with a head it
        keeps per path (building and encoding an ``httpx.Request``, and building and reading
        an ``httpx.Response``, adds client CPU to every request)."""
        data = head.request(body)
        slots = self._slots
        if slots is not None and not slots.acquire(timeout=limits.get("pool")):
            raise httpx.PoolTimeout("no free connection", request=request)
        try:
            where = head.origin
            connection = self._checkout(where) or self._connect(where, limits, request)
            try:
                parsed = connection.exchange(data, head.method == "HEAD", limits, request)
            except BaseException:
                connection.close()
                raise
            if parsed.keep_alive:
                self._checkin(where, connection)
            else:
                connection.close()
        finally:
            if slots is not None:
                slots.release()
        return parsed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _checkout(self, where: Origin) -> _Connection | None:
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._idle.get(where)
                if not idle:
                    return None
                connection = idle.pop()
            if connection.usable(now, self._expiry):
                return connection
            connection.close()

    def _checkin(self, where: Origin, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(where, [])
            if not self._closed and (self._keep is None or len(idle) < self._keep):
                idle.append(connection)
                return
        connection.close()

    def _connect(
        self, where: Origin, limits: Timeouts, request: httpx.Request | None
    ) -> _Connection:
        with connect_errors(request):
            sock = socket.create_connection(where, timeout=limits.get("connect"))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(sock)
