"""One NATS connection, made on first use and made again once it has closed.

nats-py reconnects on its own after a drop (for ever: ``max_reconnect_attempts=-1``);
while it does, requests time out, which the callers turn into ``BrokerUnavailable``. The
first connect is bounded by ``connect_timeout``. nats-py's own error callback would log a
traceback per attempt; ours logs at DEBUG, since the outbox and the consumer log an outage
once (``FailureLog``).
"""

from __future__ import annotations

import asyncio
import logging

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from qmq_outbox.errors import BrokerUnavailable
from qmq_outbox.transports.jetstream.config import JetStreamTransport

logger = logging.getLogger(__name__)

RECONNECT_WAIT = 0.5  # seconds between reconnect attempts


async def _quiet_error(exc: Exception) -> None:
    logger.debug("nats: %r", exc, extra={"action": "jetstream.connection_error"})


class Connection:
    """The connection of one producer or consumer (not shared between event loops)."""

    def __init__(self, transport: JetStreamTransport) -> None:
        self.transport = transport
        self._client: NATS | None = None
        self._lock = asyncio.Lock()

    async def client(self) -> NATS:
        client = self._client
        if client is not None and not client.is_closed:
            return client
        async with self._lock:
            if self._client is None or self._client.is_closed:
                self._client = await connect(self.transport)
            return self._client

    async def jetstream(self) -> JetStreamContext:
        client = await self.client()
        return client.jetstream(timeout=self.transport.publish_timeout.total_seconds())

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and not client.is_closed:
            await _abandon(client)


async def connect(transport: JetStreamTransport) -> NATS:
    client = NATS()
    servers = [server.strip() for server in transport.url.split(",")]
    timeout = transport.connect_timeout.total_seconds()
    try:
        await asyncio.wait_for(
            client.connect(
                servers=servers,
                name=transport.client_name,
                connect_timeout=max(1, round(timeout)),
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=RECONNECT_WAIT,  # type: ignore[arg-type]
                error_cb=_quiet_error,
            ),
            timeout,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await _abandon(client)
        raise BrokerUnavailable(f"NATS at {transport.base_url} unreachable: {exc!r}") from exc
    return client


async def _abandon(client: NATS) -> None:
    """Close ``client`` whatever state its connection is in (lost, never made)."""
    try:
        await client.close()
    except (OSError, TimeoutError, nats.errors.Error):
        logger.debug("NATS client closed with its connection broken", exc_info=True)


async def probe(transport: JetStreamTransport) -> None:
    """Connect and ask JetStream for the account's info: ``BrokerUnavailable`` if either fails."""
    client = await connect(transport)
    try:
        await client.jetstream(timeout=transport.publish_timeout.total_seconds()).account_info()
    except (TimeoutError, nats.errors.Error) as exc:
        raise BrokerUnavailable(f"JetStream at {transport.base_url}: {exc!r}") from exc
    finally:
        await client.close()
