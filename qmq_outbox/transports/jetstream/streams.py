"""JetStream streams: one per subject prefix, created when missing, checked when present.

A stream found with other storage than configured is an error (``StreamMismatch``); one
found without the prefix's subjects gets them added (it is ours by name). Each is checked
once per connection user; ``forget`` drops that, e.g. after a publish found no stream.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)

from qmq_outbox.errors import BrokerUnavailable, ConfigurationError
from qmq_outbox.transports.jetstream.config import JetStreamTransport, first_token
from qmq_outbox.transports.jetstream.connection import Connection

logger = logging.getLogger(__name__)


class StreamMismatch(ConfigurationError):
    """A stream of that name exists with settings the transport cannot use."""


def covers(pattern: str, subject: str) -> bool:
    """Whether the NATS subject ``pattern`` (``*``, ``>`` wildcards) matches every subject
    that ``subject`` (itself possibly a pattern) does."""
    wanted = subject.split(".")
    for index, token in enumerate(pattern.split(".")):
        if token == ">":
            return len(wanted) > index
        if index >= len(wanted):
            return False
        if token == "*":
            if wanted[index] == ">":
                return False
            continue
        if token != wanted[index]:
            return False
    return len(pattern.split(".")) == len(wanted)


def prefix_subjects(subject: str) -> list[str]:
    token = first_token(subject)
    return [token, f"{token}.>"]


class Streams:
    """The streams one producer or consumer has made sure of."""

    def __init__(self, transport: JetStreamTransport, connection: Connection) -> None:
        self.transport = transport
        self.connection = connection
        self._ready: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()  # concurrent publishes check a stream once

    async def ensure(self, subject: str) -> str:
        """The name of the stream that stores ``subject``, made sure of."""
        name = self.transport.stream_for(subject)
        token = first_token(subject)
        if (name, token) not in self._ready:
            async with self._lock:
                if (name, token) not in self._ready:
                    await self._ensure(name, prefix_subjects(subject))
                    self._ready.add((name, token))
        return name

    async def ensure_dead(self) -> str:
        name = self.transport.dead_stream
        if (name, "") not in self._ready:
            async with self._lock:
                if (name, "") not in self._ready:
                    await self._ensure(name, [f"{self.transport.dead_prefix}.>"])
                    self._ready.add((name, ""))
        return name

    def forget(self, subject: str) -> None:
        self._ready.discard((self.transport.stream_for(subject), first_token(subject)))

    async def _ensure(self, name: str, subjects: list[str]) -> None:
        js = await self.connection.jetstream()
        try:
            info = await self._info_or_create(js, name, subjects)
            if info is not None:
                await self._check(js, info, subjects)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BrokerUnavailable(f"JetStream stream {name}: {exc!r}") from exc

    async def _info_or_create(
        self, js: JetStreamContext, name: str, subjects: list[str]
    ) -> StreamInfo | None:
        """The stream's info if it exists; None once it was created as configured."""
        try:
            return await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            pass
        try:
            await js.add_stream(self._config(name, subjects))
        except nats.js.errors.BadRequestError:  # created meanwhile by someone else
            return await js.stream_info(name)
        logger.info(
            "created JetStream stream %s for %s",
            name,
            subjects,
            extra={"action": "jetstream.stream_created", "stream": name},
        )
        return None

    def _config(self, name: str, subjects: list[str]) -> StreamConfig:
        t = self.transport
        return StreamConfig(
            name=name,
            subjects=subjects,
            storage=StorageType.FILE if t.storage == "file" else StorageType.MEMORY,
            num_replicas=t.replicas,
            max_age=t.retention.total_seconds(),
            duplicate_window=t.duplicate_window.total_seconds(),
        )

    async def _check(self, js: JetStreamContext, info: StreamInfo, subjects: list[str]) -> None:
        config = info.config
        storage = str(getattr(config.storage, "value", config.storage) or "file")
        if storage != self.transport.storage:
            raise StreamMismatch(
                f"JetStream stream {config.name} stores on {storage}, configured "
                f"{self.transport.storage}: use another stream_prefix or recreate the stream"
            )
        have = list(config.subjects or [])
        missing = [s for s in subjects if not any(covers(pattern, s) for pattern in have)]
        if missing:
            config.subjects = have + missing
            await js.update_stream(config)
            logger.info(
                "added subjects %s to JetStream stream %s",
                missing,
                config.name,
                extra={"action": "jetstream.stream_updated", "stream": config.name},
            )


READ_BATCH = 256
READ_WAIT = 0.2  # seconds a read waits for the next batch before it calls the stream read


async def read_stream(js: JetStreamContext, stream: str, subject: str) -> list[Msg]:
    """Every message of ``stream`` on ``subject`` (a pattern) now, oldest first, read by an
    ephemeral consumer that acks nothing (inspection: dead letters, tests)."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=timedelta(seconds=30).total_seconds(),
    )
    subscription = await js.pull_subscribe(subject, stream=stream, config=config)
    found: list[Msg] = []
    try:
        while True:
            try:
                batch = await subscription.fetch(READ_BATCH, timeout=READ_WAIT)
            except TimeoutError:
                return found
            found.extend(batch)
            if batch and batch[-1].metadata.num_pending == 0:
                return found
    finally:
        name = (await subscription.consumer_info()).name
        await subscription.unsubscribe()
        await js.delete_consumer(stream, name)
