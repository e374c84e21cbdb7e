"""The qmq broker (``--fsync always``), driven by the project's ``AsyncBrokerClient``."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import psutil

from bench._broker import BenchBroker
from qmq_outbox.client import AsyncBrokerClient
from qmq_outbox.envelope import OutgoingMessage

GROUP = "peers"


class QmqProducer:
    def __init__(self, client: AsyncBrokerClient, subject: str, id_prefix: str) -> None:
        self._client = client
        self._subject = subject
        self._prefix = id_prefix
        self._ids = itertools.count()

    async def send(self, bodies: Sequence[bytes]) -> None:
        messages = [
            OutgoingMessage(id=f"{self._prefix}-{next(self._ids)}", subject=self._subject, body=b)
            for b in bodies
        ]
        results = await self._client.produce(messages)
        if len(results) != len(messages) or any(r.status != "stored" for r in results):
            raise RuntimeError(f"qmq did not store every message: {results[:3]}")


class QmqConsumer:
    """Acks ride on the next pull (``ack_and_pull``), as the SDK's ``Consumer`` sends them:
    a pull + ack is one request."""

    def __init__(self, client: AsyncBrokerClient, subject: str, consumer_id: str) -> None:
        self._client = client
        self._subject = subject
        self._consumer_id = consumer_id
        self._taken: list[int] = []
        self._acks: list[int] = []

    async def take(self, max_messages: int, wait: float) -> list[bytes]:
        options = {"max_messages": max_messages, "wait_ms": int(wait * 1000)}
        if self._acks:
            answer = await self._client.ack_and_pull(
                self._subject, GROUP, self._consumer_id, self._acks, **options
            )
            if answer.acked != len(self._acks):
                raise RuntimeError(f"qmq acked {answer.acked} of {len(self._acks)}")
            self._acks = []
            messages = answer.messages
        else:
            messages = await self._client.pull(self._subject, GROUP, self._consumer_id, **options)
        self._taken = [m.seq for m in messages]
        return [m.body for m in messages]

    async def ack(self) -> None:
        self._acks.extend(self._taken)
        self._taken = []

    async def flush(self) -> None:
        if self._acks:
            await self._client.ack(self._subject, GROUP, self._consumer_id, self._acks)
            self._acks = []


class QmqPeer:
    """A broker subprocess on a temporary data directory, one client per connection.

    The broker cannot purge a subject, so each workload gets a fresh one.
    """

    name = "qmq"
    title = "qmq broker"

    def __init__(self, *, data_root: Path) -> None:
        self._broker = BenchBroker(data_root / "qmq-data", "--fsync", "always")
        self._subject = "peers.s0"
        self._subjects = itertools.count(1)
        self._clients = itertools.count()
        self._process: psutil.Process | None = None

    @property
    def log(self) -> Path:
        return self._broker.log

    async def start(self) -> None:
        await asyncio.to_thread(self._broker.start)
        assert self._broker.proc is not None
        self._process = psutil.Process(self._broker.proc.pid)

    async def stop(self) -> None:
        await asyncio.to_thread(self._broker.stop)

    async def reset(self) -> None:
        self._subject = f"peers.s{next(self._subjects)}"

    @asynccontextmanager
    async def producer(self) -> AsyncIterator[QmqProducer]:
        async with AsyncBrokerClient(self._broker.url, max_connections=1) as client:
            yield QmqProducer(client, self._subject, f"{self._subject}-p{next(self._clients)}")

    @asynccontextmanager
    async def consumer(self, *, prefetch: int, streaming: bool) -> AsyncIterator[QmqConsumer]:
        async with AsyncBrokerClient(self._broker.url, max_connections=1) as client:
            yield QmqConsumer(client, self._subject, f"c{next(self._clients)}")

    def server_processes(self) -> list[psutil.Process]:
        if self._process is None:
            return []
        try:
            return [self._process, *self._process.children(recursive=True)]
        except psutil.Error:
            return []

    def notes(self) -> list[str]:
        return [
            "qmq broker: this checkout, `qmq broker --fsync always` on a temporary data"
            " directory, driven by the project's `AsyncBrokerClient` (one client of one"
            " connection per producer or consumer; a batch is one `produce`; a pull carries"
            " the acks of the batch before it (`ack_and_pull`), so a pull + ack is one"
            " request)"
        ]
