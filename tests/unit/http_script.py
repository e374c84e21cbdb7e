"""A real TCP server that answers HTTP/1.1 requests as a test scripts it, and the clients
that drive the SDK's transports against it.

For the transports' tests: real sockets and real timing, but answers a broker would never
give on purpose (chunked bodies, early closes, silence, malformed bytes) on demand. Each
request is handed to ``answer(request) -> Reply``; the server writes the reply's bytes (in
pieces if asked) and then keeps the connection, closes it, or stays silent. ``Blocking``,
``Awaited`` and ``AwaitedOnUvloop`` send a list of requests through ``httpx.Client`` /
``httpx.AsyncClient`` over the SDK's transports, as a user of a transport sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from qmq_outbox.http11 import AsyncHttp11Transport, Http11Transport


@dataclasses.dataclass(frozen=True)
class Seen:
    """A request as the server read it, and the connection it came on (1, 2, ...)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int


@dataclasses.dataclass(frozen=True)
class Reply:
    data: bytes = b""
    pieces: int = 1  # write ``data`` in this many parts, a short pause between them
    close: bool = False  # close the connection after writing
    delay: float = 0.0  # wait this long before writing


def ok(body: bytes = b'{"ok": true}', *, status: str = "200 OK", extra: str = "") -> Reply:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}"
    return Reply(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)


def chunked(parts: list[bytes]) -> Reply:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nx-t: 1\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
    return Reply(head + b"\r\n" + body)


class ScriptedServer:
    """Serves on 127.0.0.1 until closed; ``seen`` lists every request read."""

    def __init__(self, answer: Callable[[Seen], Reply]) -> None:
        self.answer = answer
        self.seen: list[Seen] = []
        self.connections = 0
        self.closed = 0  # connections the server has closed
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="scripted-accept", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        for sock in list(self._open):
            sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # pieces go as pieces
            self.connections += 1
            self._open.append(sock)
            args = (sock, self.connections)
            threading.Thread(target=self._serve, args=args, name="scripted", daemon=True).start()

    def _serve(self, sock: socket.socket, number: int) -> None:
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                request_line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ")
                headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                seen = Seen(method, path, headers, body, number)
                self.seen.append(seen)
                reply = self.answer(seen)
                time.sleep(reply.delay)
                step = max(1, -(-len(reply.data) // reply.pieces))
                for start in range(0, len(reply.data), step):
                    sock.sendall(reply.data[start : start + step])
                    if reply.pieces > 1:
                        time.sleep(0.002)
                if reply.close:
                    return
        except OSError:
            return
        finally:
            sock.close()
            self.closed += 1

    def wait_closed(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.closed < count:
            assert time.monotonic() < deadline, "the server did not close the connection"
            time.sleep(0.005)


@contextmanager
def scripted(answer: Callable[[Seen], Reply]) -> Iterator[ScriptedServer]:
    server = ScriptedServer(answer)
    try:
        yield server
    finally:
        server.close()


# -- the clients --------------------------------------------------------------------------

Call = tuple[str, str, dict[str, Any]] | Callable[[], None]  # a request, or a pause


def get(path: str = "/", **options: Any) -> tuple[str, str, dict[str, Any]]:
    return ("GET", path, options)


def post(path: str, body: bytes, **options: Any) -> tuple[str, str, dict[str, Any]]:
    return ("POST", path, {"content": body, **options})


class Blocking:
    """``run(url, [(method, path, options), ...])`` with the blocking transport: each
    request's response, or the ``httpx.HTTPError`` it raised."""

    name = "sync"

    def __init__(self, **limits: Any) -> None:
        self.transport = Http11Transport(limits=httpx.Limits(**limits))

    def run(self, url: str, calls: list[Call]) -> list[Any]:
        results: list[Any] = []
        with httpx.Client(base_url=url, transport=self.transport) as client:
            for call in calls:
                if callable(call):
                    call()
                    continue
                method, path, options = call
                try:
                    results.append(client.request(method, path, **options))
                except httpx.HTTPError as exc:
                    results.append(exc)
        return results


class Awaited(Blocking):
    name = "async"

    def __init__(self, **limits: Any) -> None:
        self.async_transport = AsyncHttp11Transport(limits=httpx.Limits(**limits))

    def run(self, url: str, calls: list[Call]) -> list[Any]:
        async def main() -> list[Any]:
            results: list[Any] = []
            transport = self.async_transport
            async with httpx.AsyncClient(base_url=url, transport=transport) as client:
                for call in calls:
                    if callable(call):
                        call()
                        continue
                    method, path, options = call
                    try:
                        results.append(await client.request(method, path, **options))
                    except httpx.HTTPError as exc:
                        results.append(exc)
            return results

        return self.loop_run(main())

    def loop_run(self, main: Coroutine[Any, Any, list[Any]]) -> list[Any]:
        return asyncio.run(main)


class AwaitedOnUvloop(Awaited):
    """uvloop's transports are not asyncio's classes; the protocol must not care."""

    name = "uvloop"

    def loop_run(self, main: Coroutine[Any, Any, list[Any]]) -> list[Any]:
        uvloop = pytest.importorskip("uvloop")
        result: list[Any] = uvloop.run(main)
        return result


KINDS = [Blocking, Awaited, AwaitedOnUvloop]
KIND_IDS = ["sync", "async", "uvloop"]
