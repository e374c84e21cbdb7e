"""A TCP forwarder on 127.0.0.1 that a test can cut and restore: an outage of one client's
path to a shared service, without stopping the service other tests use."""

from __future__ import annotations

import asyncio
import contextlib

from qmq_outbox.transports.blocking import LoopThread
from tests.support.broker_process import free_port

CHUNK = 65536


class Proxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target``; ``cut()`` closes the listener
    and every connection (new ones are refused), ``restore()`` listens again."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._loop = LoopThread(f"proxy-{target}")
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.restore()

    def restore(self) -> None:
        self._loop.run(self._listen(), 10)

    def cut(self) -> None:
        self._loop.run(self._cut(), 10)

    def close(self) -> None:
        self.cut()
        self._loop.close()

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                "127.0.0.1", self.target
            )
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, upstream_writer))
        await asyncio.gather(
            _pipe(reader, upstream_writer), _pipe(upstream_reader, writer), return_exceptions=True
        )
        for each in (writer, upstream_writer):
            self._writers.discard(each)
            each.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()
