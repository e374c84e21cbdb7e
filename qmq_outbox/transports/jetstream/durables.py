"""Durable pull consumers: one per (group, subject), made by the group's consumers at their
first pull, or ahead of them for the groups a producer declares (``groups``).

Where a group starts (``DeliverPolicy``) is decided once, by whoever makes its consumer
first; making it again keeps that and updates the lease and attempts.
"""

from __future__ import annotations

import contextlib

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from qmq_outbox.calls import StartAt
from qmq_outbox.errors import BrokerUnavailable
from qmq_outbox.transports.jetstream.config import JetStreamTransport
from qmq_outbox.transports.jetstream.connection import Connection
from qmq_outbox.transports.jetstream.streams import Streams


async def ensure_durable(
    js: JetStreamContext,
    transport: JetStreamTransport,
    stream: str,
    group: str,
    subject: str,
    start: StartAt,
) -> str:
    """Make or update ``group``'s durable consumer of ``subject`` in ``stream``; its name."""
    durable = transport.durable_name(group, subject)
    config = ConsumerConfig(
        durable_name=durable,
        deliver_policy=DeliverPolicy.ALL if start == "earliest" else DeliverPolicy.NEW,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=transport.lease.total_seconds(),
        max_deliver=transport.max_attempts + 1,
        filter_subject=subject,
        max_ack_pending=-1,  # the consumers' own budgets bound what they hold
    )
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            found = await js.consumer_info(stream, durable)
            config.deliver_policy = found.config.deliver_policy
        await js.add_consumer(stream, config)  # updates lease and attempts, if changed
    except (TimeoutError, nats.errors.Error) as exc:
        raise BrokerUnavailable(f"JetStream consumer {durable} on {stream}: {exc!r}") from exc
    return durable


async def declare_groups(connection: Connection, streams: Streams) -> list[str]:
    """The streams and durable consumers of every group the transport declares."""
    transport = connection.transport
    made: list[str] = []
    for group, subject in transport.declared:
        stream = await streams.ensure(subject)
        js = await connection.jetstream()
        durable = await ensure_durable(
            js, transport, stream, group, subject, transport.groups_start
        )
        made.append(f"consumer {durable} of group {group} on {subject} (stream {stream})")
    return made


async def declare_topology(transport: JetStreamTransport) -> list[str]:
    """``declare_groups`` on a connection of its own."""
    connection = Connection(transport)
    try:
        return await declare_groups(connection, Streams(transport, connection))
    finally:
        await connection.close()
