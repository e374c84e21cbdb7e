"""The qmq broker as a transport: its HTTP clients, unchanged (the default)."""

from __future__ import annotations

import dataclasses

from qmq_outbox.calls import Call
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.transports.base import Capabilities, ConsumerSpec
from qmq_outbox.transports.urls import check_qmq_url

CAPABILITIES = Capabilities(dedup=True, delay=True, ordered=True, broadcast=True, tag_filter=True)
_HEALTH = Call(method="GET", path="/healthz", read=lambda doc: doc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QmqTransport:
    """The qmq broker at ``url`` (``http(s)://host:port``), with a bearer ``token``."""

    url: str
    token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_qmq_url(self.url)  # a path or a stray query would dead-end every request

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def producer(self) -> BrokerClient:
        return BrokerClient(self.url, token=self.token)

    def async_producer(self) -> AsyncBrokerClient:
        return AsyncBrokerClient(self.url, token=self.token)

    async def open_consumer(self, spec: ConsumerSpec) -> AsyncBrokerClient:
        """The broker keeps groups itself: a client with a connection per request in flight."""
        return AsyncBrokerClient(self.url, token=self.token, max_connections=spec.connections)

    def check(self) -> None:
        with BrokerClient(self.url, token=self.token) as client:
            client.send(_HEALTH)
