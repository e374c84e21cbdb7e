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
    """Broker subprocesses on temporary data directories, one client per connection.

    ``brokers`` 2 runs two independent brokers and deals the producers and consumers out
    between them in turn (system ``qmq-pair``): each does every part of the work for half
    of the messages, with nothing to coordinate, so it bounds from above what any split of
    one broker over the box's two cores could store and serve with today's per-message
    costs. The broker cannot purge a subject, so each workload gets a fresh one.
    """

    def __init__(self, *, data_root: Path, brokers: int = 1) -> None:
        self.name = "qmq" if brokers == 1 else "qmq-pair"
        self.title = "qmq broker" if brokers == 1 else "two qmq brokers"
        self._brokers = [
            BenchBroker(data_root / f"{self.name}-data-{n}", "--fsync", "always")
            for n in range(brokers)
        ]
        self._subject = "peers.s0"
        self._subjects = itertools.count(1)
        self._clients = itertools.count()
        self._processes: list[psutil.Process] = []

    @property
    def log(self) -> Path:
        return self._brokers[0].log

    async def start(self) -> None:
        for broker in self._brokers:
            await asyncio.to_thread(broker.start)
            assert broker.proc is not None
            self._processes.append(psutil.Process(broker.proc.pid))

    async def stop(self) -> None:
        for broker in self._brokers:
            await asyncio.to_thread(broker.stop)

    async def reset(self) -> None:
        self._subject = f"peers.s{next(self._subjects)}"

    def _next_url(self) -> tuple[int, str]:
        number = next(self._clients)
        return number, self._brokers[number % len(self._brokers)].url

    @asynccontextmanager
    async def producer(self) -> AsyncIterator[QmqProducer]:
        number, url = self._next_url()
        async with AsyncBrokerClient(url, max_connections=1) as client:
            yield QmqProducer(client, self._subject, f"{self._subject}-p{number}")

    @asynccontextmanager
    async def consumer(self, *, prefetch: int, streaming: bool) -> AsyncIterator[QmqConsumer]:
        number, url = self._next_url()
        async with AsyncBrokerClient(url, max_connections=1) as client:
            yield QmqConsumer(client, self._subject, f"c{number}")

    def server_processes(self) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        for process in self._processes:
            try:
                found += [process, *process.children(recursive=True)]
            except psutil.Error:
                pass
        return found

    def notes(self) -> list[str]:
        note = (
            "qmq broker: this checkout, `qmq broker --fsync always` on a temporary data"
            " directory, driven by the project's `AsyncBrokerClient` (one client of one"
            " connection per producer or consumer; a batch is one `produce`; a pull carries"
            " the acks of the batch before it (`ack_and_pull`), so a pull + ack is one"
            " request)"
        )
        if len(self._brokers) > 1:
            note = (
                f"two qmq brokers: {len(self._brokers)} brokers as above, each on its own"
                " data directory and port, the producers and consumers dealt out between them"
                " in turn; an upper bound for a front-end / storage-owner split of one broker"
            )
        return [note]
