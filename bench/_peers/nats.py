"""NATS JetStream through nats-py: a file-storage work-queue stream, publishes that await
their PubAck; drained by a durable pull consumer (``fetch`` of a batch), and end to end by a
push consumer (``fetch`` of a batch waits for the batch to fill, a push does not)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import nats
import nats.errors
import nats.js.errors
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType

from bench._peers.common import Inbox, processes_named, version_of

DURABLE = "peers"
PULL_MAX_ACK_PENDING = 10_000  # never the limit when draining


def fsync_note(major: int, minor: int, version: str) -> str:
    """What a PubAck promises on this server version (nats-server's filestore.go)."""
    if (major, minor) < (2, 10):
        return (
            f"nats-server {version} has no `sync_interval` setting (it came in 2.10): its file"
            " store fsyncs in the background every 2 minutes (`defaultSyncInterval`), not per"
            " publish or ack, so a PubAck means written to the page cache, not to disk"
        )
    return (
        f"nats-server {version}: the file store fsyncs every `sync_interval` (2 minutes"
        " unless the server's config sets it; `always` would fsync each write), which this"
        " script does not read"
    )


async def _connect(url: str) -> Client:
    # no reconnects: a server that is down fails the run at once, and a reconnect in the
    # middle of a workload would distort it
    return await nats.connect(
        url, allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.1
    )


class NatsProducer:
    def __init__(self, js: JetStreamContext, subject: str) -> None:
        self._js = js
        self._subject = subject

    async def send(self, bodies: Sequence[bytes]) -> None:
        await asyncio.gather(*(self._js.publish(self._subject, b) for b in bodies))


class NatsPullConsumer:
    def __init__(self, subscription: JetStreamContext.PullSubscription) -> None:
        self._subscription = subscription
        self._messages: list[Msg] = []

    async def take(self, max_messages: int, wait: float) -> list[bytes]:
        try:
            self._messages = await self._subscription.fetch(max_messages, timeout=wait)
        except (nats.errors.TimeoutError, TimeoutError):
            self._messages = []
        return [m.data for m in self._messages]

    async def ack(self) -> None:
        for message in self._messages:
            await message.ack()  # not awaited by the server: a publish to the ack subject

    async def flush(self) -> None:
        pass  # acks are sent at once


class NatsPushConsumer:
    def __init__(self) -> None:
        self.inbox: Inbox[Msg] = Inbox()
        self._messages: list[Msg] = []

    async def deliver(self, message: Msg) -> None:
        self.inbox.put(message)

    async def take(self, max_messages: int, wait: float) -> list[bytes]:
        self._messages = await self.inbox.take(max_messages, wait)
        return [m.data for m in self._messages]

    async def ack(self) -> None:
        for message in self._messages:
            await message.ack()

    async def flush(self) -> None:
        pass  # acks are sent at once


class NatsPeer:
    """A stream of its own, added by ``start`` and deleted by ``stop``."""

    name = "nats"
    title = "NATS JetStream"  # flagged after start when the server does not fsync per ack

    def __init__(self, *, url: str) -> None:
        self._url = url
        self._stream = f"QMQPEERS{os.getpid()}"
        self._subject = f"qmqpeers{os.getpid()}.queue"
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._version = (0, 0, "?")

    async def start(self) -> None:
        self._nc = await _connect(self._url)
        self._js = self._nc.jetstream()
        await self._js.add_stream(
            name=self._stream,
            subjects=[self._subject],
            storage=StorageType.FILE,
            retention=RetentionPolicy.WORK_QUEUE,
        )
        server = self._nc.connected_server_version
        if (server.major, server.minor) < (2, 10):
            self.title = "NATS JetStream (no fsync per ack)"
        self._version = (
            server.major,
            server.minor,
            f"{server.major}.{server.minor}.{server.patch}",
        )

    async def stop(self) -> None:
        if self._js is not None:
            await self._js.delete_stream(self._stream)
        if self._nc is not None:
            await self._nc.close()

    async def reset(self) -> None:
        assert self._js is not None
        try:
            await self._js.delete_consumer(self._stream, DURABLE)
        except nats.js.errors.NotFoundError:
            pass
        await self._js.purge_stream(self._stream)

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[Client]:
        nc = await _connect(self._url)
        try:
            yield nc
        finally:
            await nc.close()

    @asynccontextmanager
    async def producer(self) -> AsyncIterator[NatsProducer]:
        async with self._connection() as nc:
            yield NatsProducer(nc.jetstream(), self._subject)

    @asynccontextmanager
    async def consumer(
        self, *, prefetch: int, streaming: bool
    ) -> AsyncIterator[NatsPullConsumer | NatsPushConsumer]:
        async with self._connection() as nc:
            js = nc.jetstream()
            if not streaming:
                config = ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT, max_ack_pending=PULL_MAX_ACK_PENDING
                )
                yield NatsPullConsumer(
                    await js.pull_subscribe(
                        self._subject, durable=DURABLE, stream=self._stream, config=config
                    )
                )
                return
            push = NatsPushConsumer()
            subscription = await js.subscribe(
                self._subject,
                cb=push.deliver,
                durable=DURABLE,
                stream=self._stream,
                manual_ack=True,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=prefetch),
            )
            try:
                yield push
            finally:
                await subscription.unsubscribe()

    def server_processes(self) -> list[psutil.Process]:
        return processes_named("nats-server")

    def notes(self) -> list[str]:
        major, minor, version = self._version
        return [
            f"NATS {version} JetStream (nats-py {version_of('nats-py')}): file storage, work-queue"
            " retention; a batch is 100 publishes awaited together for their PubAcks; drained"
            " by a durable pull consumer (`fetch(100)`, one ack per message, not confirmed);"
            " end to end by a push consumer with `max_ack_pending` 100. "
            + fsync_note(major, minor, version)
        ]
