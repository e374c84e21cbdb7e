"""The consumer's client port (``PullClient``, defined with the other side of the transport
seam in ``qmq_outbox.transports.base``), and an adapter that lets ``run()`` use a blocking
client."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

from qmq_outbox.calls import AckedPull
from qmq_outbox.client import BrokerClient
from qmq_outbox.consumer.threads import ThreadPool
from qmq_outbox.envelope import Message
from qmq_outbox.transports.base import PullClient

__all__ = ["OnThreads", "PullClient", "is_async_client"]


def is_async_client(client: object) -> bool:
    return inspect.iscoroutinefunction(getattr(client, "pull", None))


class OnThreads:
    """A blocking client (a ``BrokerClient``, or anything with its ``pull/ack/nack``) as a
    ``PullClient``: each call runs on one of ``threads``, so a long poll blocks neither the
    loop nor the handlers."""

    def __init__(self, client: BrokerClient, threads: ThreadPool) -> None:
        self._client = client
        self._threads = threads

    @property
    def base_url(self) -> str:
        return str(getattr(self._client, "base_url", type(self._client).__name__))

    async def pull(self, subject: str, group: str, consumer: str, **options: Any) -> list[Message]:
        return await self._threads.run(
            functools.partial(self._client.pull, subject, group, consumer, **options)
        )

    async def ack(
        self, subject: str, group: str, consumer: str, seqs: Sequence[int], **options: Any
    ) -> dict[str, Any]:
        return await self._threads.run(
            functools.partial(self._client.ack, subject, group, consumer, seqs, **options)
        )

    async def ack_and_pull(
        self, subject: str, group: str, consumer: str, ack: Sequence[int], **options: Any
    ) -> AckedPull:
        return await self._threads.run(
            functools.partial(self._client.ack_and_pull, subject, group, consumer, ack, **options)
        )

    async def nack(
        self, subject: str, group: str, consumer: str, seqs: Sequence[int], **options: Any
    ) -> dict[str, Any]:
        return await self._threads.run(
            functools.partial(self._client.nack, subject, group, consumer, seqs, **options)
        )
