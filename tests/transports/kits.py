"""One kit per transport: its URL, and what the tests need to see inside it.

A kit names everything it creates after the session's tag (streams, exchanges, queues,
subjects), so runs never see each other's data, and removes it at the end. ``stored``
reads what the transport holds for a subject (every copy, by message id); ``prepare``
makes the RabbitMQ queues a publish needs (a group's queue exists once its consumer
started; a witness queue keeps a copy of everything for ``stored``).
"""

from __future__ import annotations

import abc
import uuid
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

from qmq_outbox.client import BrokerClient
from qmq_outbox.errors import BrokerRejected
from qmq_outbox.transports import from_url
from qmq_outbox.transports.base import ConsumerSpec, DeadLetter, Transport
from qmq_outbox.transports.blocking import LoopThread
from tests.support.outbox import stored_ids

T = TypeVar("T")
WITNESS = "witness"


def spec_of(group: str, *subjects: str) -> ConsumerSpec:
    return ConsumerSpec(
        group=group,
        consumer_id="test",
        subjects=subjects,
        start="earliest",
        capacity=16,
        connections=4,
    )


class Kit(abc.ABC):
    """A transport under test, reached at ``url`` (``port`` given: through a proxy)."""

    name: str

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._loop = LoopThread(f"kit-{self.name}")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro, 30)

    @abc.abstractmethod
    def url(self, port: int | None = None) -> str: ...

    @property
    @abc.abstractmethod
    def port(self) -> int: ...

    def transport(self, port: int | None = None) -> Transport:
        return from_url(self.url(port))

    def subject(self, prefix: str = "") -> str:
        """A new subject of this session (JetStream: in the session's stream, or in one
        of its own with ``prefix``)."""
        return f"qt{self.tag}{prefix}.{uuid.uuid4().hex[:10]}"

    def group(self) -> str:
        return f"g{self.tag}-{uuid.uuid4().hex[:6]}"

    def prepare(self, subject: str, *groups: str) -> None:  # noqa: B027 - most need nothing
        """Make ready what a publish on ``subject`` for ``groups`` needs."""

    @abc.abstractmethod
    def stored(self, subject: str) -> Counter[str]: ...

    @abc.abstractmethod
    def dead_letters(self, subject: str, group: str) -> list[DeadLetter]: ...

    def close(self) -> None:
        self._loop.close()


class QmqKit(Kit):
    name = "qmq"

    def __init__(self, tag: str, broker_url: str) -> None:
        super().__init__(tag)
        self.broker_url = broker_url
        self.client = BrokerClient(broker_url)

    def url(self, port: int | None = None) -> str:
        return self.broker_url if port is None else f"http://127.0.0.1:{port}"

    @property
    def port(self) -> int:
        return int(self.broker_url.rsplit(":", 1)[1])

    def stored(self, subject: str) -> Counter[str]:
        return stored_ids(self.client, subject)

    def dead_letters(self, subject: str, group: str) -> list[DeadLetter]:
        try:
            dead = self.client.dead_letters(subject, group)["dead"]
        except BrokerRejected as exc:  # the group is not known before its first pull
            if exc.status == 404:
                return []
            raise
        return [
            DeadLetter(
                id=entry["message"]["id"],
                subject=subject,
                group=group,
                attempts=entry["attempts"],
                error=entry["error"],
                body=entry["message"]["body"].encode(),
                headers=entry["message"].get("headers") or {},
            )
            for entry in dead
        ]

    def close(self) -> None:
        self.client.close()
        super().close()


class JetStreamKit(Kit):
    name = "jetstream"
    server = "127.0.0.1:4222"
    options = "lease=1s&max_attempts=3&publish_timeout=1s&connect_timeout=1s"

    def url(self, port: int | None = None) -> str:
        where = self.server if port is None else f"127.0.0.1:{port}"
        prefix = f"stream_prefix=QT{self.tag}&dead_prefix=qt{self.tag}-dead"
        return f"nats://{where}?{prefix}&{self.options}"

    @property
    def port(self) -> int:
        return 4222

    def stored(self, subject: str) -> Counter[str]:
        return Counter(self.run(self._stored(subject)))

    async def _stored(self, subject: str) -> list[str]:
        from qmq_outbox.transports.jetstream.connection import connect
        from qmq_outbox.transports.jetstream.producer import MSG_ID
        from qmq_outbox.transports.jetstream.streams import read_stream

        transport = self.transport()
        client = await connect(transport)  # type: ignore[arg-type]
        try:
            js = client.jetstream()
            stream = transport.stream_for(subject)  # type: ignore[attr-defined]
            try:
                found = await read_stream(js, stream, subject)
            except Exception as exc:  # no stream yet: nothing stored
                if "not found" in str(exc).lower() or "no stream" in str(exc).lower():
                    return []
                raise
            return [(msg.headers or {}).get(MSG_ID, "?") for msg in found]
        finally:
            await client.close()

    def delete_stream_of(self, subject: str) -> None:
        self.run(self._delete_streams([self.transport().stream_for(subject)]))  # type: ignore[attr-defined]

    def dead_letters(self, subject: str, group: str) -> list[DeadLetter]:
        async def read() -> list[DeadLetter]:
            client = await self.transport().open_consumer(spec_of(group, subject))
            try:
                return await client.dead_letters(subject)  # type: ignore[attr-defined,no-any-return]
            finally:
                await client.aclose()

        return self.run(read())

    async def _delete_streams(self, names: list[str] | None = None) -> None:
        from qmq_outbox.transports.jetstream.connection import connect

        client = await connect(self.transport())  # type: ignore[arg-type]
        try:
            js = client.jetstream()
            if names is None:
                names = [
                    info.config.name
                    for info in await js.streams_info()
                    if info.config.name and info.config.name.startswith(f"QT{self.tag}")
                ]
            for name in names:
                try:
                    await js.delete_stream(name)
                except Exception:  # already gone
                    pass
        finally:
            await client.close()

    def close(self) -> None:
        self.run(self._delete_streams())
        super().close()


class RabbitMqKit(Kit):
    name = "rabbitmq"
    server = "127.0.0.1:5672"
    options = "max_attempts=3&publish_timeout=1s&connect_timeout=1s"

    def __init__(self, tag: str) -> None:
        super().__init__(tag)
        self._declared: set[tuple[str, str]] = set()

    def url(self, port: int | None = None) -> str:
        where = self.server if port is None else f"127.0.0.1:{port}"
        return f"amqp://guest:guest@{where}/?exchange=qt{self.tag}&{self.options}"

    @property
    def port(self) -> int:
        return 5672

    def prepare(self, subject: str, *groups: str) -> None:
        wanted = [(group, subject) for group in (WITNESS, *groups)]
        self.run(self._declare(wanted))
        self._declared.update(wanted)

    async def _declare(self, pairs: list[tuple[str, str]]) -> None:
        from qmq_outbox.transports.rabbitmq.connection import (
            connect,
            declare_exchange,
            declare_group,
        )

        transport = self.transport()
        connection = await connect(transport)  # type: ignore[arg-type]
        try:
            channel = await connection.channel()
            exchange = await declare_exchange(channel, transport)  # type: ignore[arg-type]
            for group, subject in pairs:
                await declare_group(channel, exchange, transport, group, subject)  # type: ignore[arg-type]
        finally:
            await connection.close()

    def stored(self, subject: str) -> Counter[str]:
        """Every message routed to ``subject`` since ``prepare`` (the witness queue's copies,
        taken out of it)."""
        return Counter(self.run(self._drain(f"{WITNESS}.{subject}")))

    async def _drain(self, queue_name: str) -> list[str]:
        from qmq_outbox.transports.rabbitmq.connection import connect

        connection = await connect(self.transport())  # type: ignore[arg-type]
        ids: list[str] = []
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(queue_name, passive=True)
            while (incoming := await queue.get(no_ack=True, fail=False)) is not None:
                ids.append(incoming.message_id or "?")
        finally:
            await connection.close()
        return ids

    def dead_letters(self, subject: str, group: str) -> list[DeadLetter]:
        async def read() -> list[DeadLetter]:
            client = await self.transport().open_consumer(spec_of(group, subject))
            return await client.dead_letters(subject)  # type: ignore[attr-defined,no-any-return]

        return self.run(read())

    async def _delete_all(self) -> None:
        from qmq_outbox.transports.rabbitmq.connection import connect

        transport = self.transport()
        connection = await connect(transport)  # type: ignore[arg-type]
        try:
            for group, subject in self._declared:
                name = transport.queue_name(group, subject)  # type: ignore[attr-defined]
                for queue in (name, f"{name}.retry", f"{name}.dead"):
                    channel = await connection.channel()
                    await channel.queue_delete(queue)
                    await channel.close()
            channel = await connection.channel()
            await channel.exchange_delete(f"qt{self.tag}")
        finally:
            await connection.close()

    def close(self) -> None:
        self.run(self._delete_all())
        super().close()
