"""The floor under the broker's CPU per message: the least any durable broker on the qmq
broker's server stack (uvicorn with httptools on uvloop, one process) must do per message,
and nothing else. Run beside ``qmq`` (``--systems qmq,floor``), it says how much of the
broker's cost per message is that stack's own.

The floor server (``python -m bench._peers.floor --port P --data-dir D``) keeps one log
file and a queue in memory. ``POST /produce``: the framed bodies are appended to the log
and fdatasynced (on the loop: the cheapest way) before the answer, then queued. ``POST
/pull``: the acks it carries (a count) and the lease of what it takes are appended as one
record and fdatasynced before the answer; with nothing queued it long-polls (a future the
next produce resolves). No routing, no index, no dedup, no JSON, no metrics: a message is
one produce, a share of one pull and two fdatasyncs, as in the broker at low rates.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil

from bench._broker import free_port

_LENGTH = struct.Struct(">I")
ROOT = Path(__file__).resolve().parents[2]  # the checkout, where ``bench`` imports from
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def frames(bodies: Sequence[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(b)) + b for b in bodies)


def unframe(data: bytes) -> list[bytes]:
    bodies, at = [], 0
    while at < len(data):
        (length,) = _LENGTH.unpack_from(data, at)
        bodies.append(data[at + 4 : at + 4 + length])
        at += 4 + length
    return bodies


class FloorApp:
    """The ASGI app of the floor server; see the module docstring."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(data_dir / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._queue: deque[bytes] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()

    def _durable(self, record: bytes) -> None:
        os.write(self._fd, record)
        os.fdatasync(self._fd)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body"):
                break
        headers = dict(scope["headers"])
        if scope["path"] == "/produce":
            self._durable(body)
            self._queue.extend(unframe(body))
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    break
            answer = b"ok"
        else:
            answer = await self._pull(headers)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    async def _pull(self, headers: dict[bytes, bytes]) -> bytes:
        acks = int(headers.get(b"x-acks", b"0"))
        most = int(headers.get(b"x-max", b"1"))
        if not self._queue and not acks:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, int(headers.get(b"x-wait-ms", b"0")) / 1000)
            except TimeoutError:
                pass
        taken = [self._queue.popleft() for _ in range(min(most, len(self._queue)))]
        if taken or acks:
            self._durable(b"A%dL%d\n" % (acks, len(taken)))
        return frames(taken)


class _Connection:
    """One keep-alive HTTP/1.1 connection to the floor server (Content-Length answers)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self._port)

    async def post(self, path: str, body: bytes, headers: str = "") -> bytes:
        assert self._reader is not None
        assert self._writer is not None
        self._writer.write(
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {len(body)}\r\n"
            f"{headers}\r\n".encode()
            + body
        )
        head = await self._reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return await self._reader.readexactly(length)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()


class FloorProducer:
    def __init__(self, connection: _Connection) -> None:
        self._connection = connection

    async def send(self, bodies: Sequence[bytes]) -> None:
        if await self._connection.post("/produce", frames(bodies)) != b"ok":
            raise RuntimeError("the floor server did not store the messages")


class FloorConsumer:
    """Acks ride on the next pull, as with the qmq broker's ``ack_and_pull``."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self._taken = 0
        self._acks = 0

    async def take(self, max_messages: int, wait: float) -> list[bytes]:
        headers = f"x-acks: {self._acks}\r\nx-max: {max_messages}\r\n"
        # as the SDK's consumer: a pull carrying acks does not long-poll
        headers += f"x-wait-ms: {0 if self._acks else int(wait * 1000)}\r\n"
        self._acks = 0
        bodies = unframe(await self._connection.post("/pull", b"", headers))
        self._taken = len(bodies)
        return bodies

    async def ack(self) -> None:
        self._acks += self._taken
        self._taken = 0

    async def flush(self) -> None:
        if self._acks:
            await self._connection.post("/pull", b"", f"x-acks: {self._acks}\r\nx-max: 0\r\n")
            self._acks = 0


class FloorPeer:
    """The floor server as a subprocess on a temporary data directory."""

    def __init__(self, *, data_root: Path) -> None:
        self.name = "floor"
        self.title = "floor (same server stack, nothing else)"
        self._data_root = data_root
        self._generation = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._port = 0

    async def start(self) -> None:
        self._port = free_port()
        self._generation += 1
        data_dir = self._data_root / f"floor-{self._generation}"
        command = [sys.executable, "-m", "bench._peers.floor", "--port", str(self._port)]
        command += ["--data-dir", str(data_dir)]
        self._proc = await asyncio.to_thread(subprocess.Popen, command, cwd=ROOT)
        for _ in range(600):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self._port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return
        raise TimeoutError("the floor server did not start")

    async def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            await asyncio.to_thread(self._proc.wait, 30)

    async def reset(self) -> None:
        """A fresh server: an empty queue."""
        await self.stop()
        await self.start()

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[_Connection]:
        connection = _Connection(self._port)
        await connection.open()
        try:
            yield connection
        finally:
            await connection.close()

    @asynccontextmanager
    async def producer(self) -> AsyncIterator[FloorProducer]:
        async with self._connection() as connection:
            yield FloorProducer(connection)

    @asynccontextmanager
    async def consumer(self, *, prefetch: int, streaming: bool) -> AsyncIterator[FloorConsumer]:
        async with self._connection() as connection:
            yield FloorConsumer(connection)

    def server_processes(self) -> list[psutil.Process]:
        if self._proc is None or self._proc.poll() is not None:
            return []
        return [psutil.Process(self._proc.pid)]

    def notes(self) -> list[str]:
        return [
            "floor: not a broker, the least one must do per message on the qmq broker's"
            " server stack (uvicorn + httptools on uvloop, one process): produce = append +"
            " fdatasync on the loop; pull = long poll, then the acks it carries and the lease"
            " of what it takes appended + fdatasynced; no routing, index, dedup, JSON or"
            " metrics (bench/_peers/floor.py)"
        ]


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    args = parser.parse_args()
    uvicorn.run(
        FloorApp(args.data_dir),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
