"""``RabbitMqTransport``: the settings of the RabbitMQ transport, and its names.

Importing this module does not import aio-pika; the producer and consumer modules do, when
first used (the ``rabbitmq`` extra).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar

from qmq_outbox.errors import ConfigurationError
from qmq_outbox.transports.base import Capabilities, ConsumerSpec
from qmq_outbox.transports.blocking import LoopTransport
from qmq_outbox.transports.topology import Groups, group_pairs

if TYPE_CHECKING:
    from qmq_outbox.transports.rabbitmq.consumer import RabbitMqConsumer
    from qmq_outbox.transports.rabbitmq.producer import RabbitMqProducer

CAPABILITIES = Capabilities(dedup=False, delay=False, ordered=False, broadcast=False)
MAX_QUEUE_NAME = 255 - len(".retry")  # AMQP short strings; the suffixes must fit too


@dataclasses.dataclass(frozen=True, kw_only=True)
class RabbitMqTransport(LoopTransport):
    """RabbitMQ at ``url`` (``amqp://user:password@host:port/vhost``).

    Producing: to the durable topic exchange ``exchange`` with routing key = subject,
    persistent, ``message_id`` = the outbox id, each awaited as a publisher confirm. With
    ``mandatory`` a message no queue is bound for is returned as unroutable, not dropped
    silently: its outbox row stays pending and is retried until a queue takes it or the
    compensator's ``unroutable_dead_after`` passes. RabbitMQ keeps no ids, so a resend
    is stored again: the consumer's ``IdempotentStore`` drops the second copy.

    Consuming: each (group, subject) has a queue ``<group>.<subject>`` (``queue_type``
    ``quorum``, or ``classic``) bound to the exchange, declared by the group's consumers at
    start: a group gets what is published after its queue first exists. Retries wait in
    ``<group>.<subject>.retry`` (per-message TTL, then dead-lettered back); after
    ``max_attempts`` a message goes to ``<group>.<subject>.dead`` with its error.

    ``groups`` (subject -> group names) are declared by the producer before its first
    publish, and by ``declare()``: their queues exist before any of their consumers starts.
    """

    kind: ClassVar[str] = "rabbitmq"
    url: str = "amqp://guest:guest@127.0.0.1:5672/"
    exchange: str = "qmq"
    queue_type: str = "quorum"
    max_attempts: int = 16
    mandatory: bool = True
    publish_timeout: timedelta = timedelta(seconds=5)
    connect_timeout: timedelta = timedelta(seconds=5)
    groups: Groups = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        group_pairs(self.groups)  # names checked when configured, not at the first publish
        if importlib.util.find_spec("aio_pika") is None:
            raise ConfigurationError("the RabbitMQ transport needs qmq-outbox[rabbitmq] (aio-pika)")
        if self.queue_type not in ("quorum", "classic"):
            raise ConfigurationError(f"queue_type: quorum or classic, not {self.queue_type!r}")
        if self.max_attempts < 1 or not self.exchange:
            raise ConfigurationError("RabbitMQ max_attempts must be >= 1 and exchange named")

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def queue_name(self, group: str, subject: str) -> str:
        """The group's queue of ``subject`` (hashed when too long for AMQP)."""
        name = f"{group}.{subject}"
        if len(name.encode()) <= MAX_QUEUE_NAME:
            return name
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        return f"{name.encode()[: MAX_QUEUE_NAME - 17].decode(errors='ignore')}.{digest}"

    # -- what it makes ---------------------------------------------------------------------

    def async_producer(self) -> RabbitMqProducer:
        from qmq_outbox.transports.rabbitmq.producer import RabbitMqProducer

        return RabbitMqProducer(self)

    async def open_consumer(self, spec: ConsumerSpec) -> RabbitMqConsumer:
        from qmq_outbox.transports.rabbitmq.consumer import RabbitMqConsumer

        return RabbitMqConsumer(self, spec)

    async def _declaring(self) -> list[str]:
        """Declare the exchange and every declared group's queues now (again: harmless)."""
        from qmq_outbox.transports.rabbitmq.connection import declare_topology

        return await declare_topology(self)

    async def _probing(self) -> None:
        from qmq_outbox.transports.rabbitmq.connection import probe

        await probe(self)


def transport_from_url(url: str) -> RabbitMqTransport:
    """``amqp://...?exchange=...&max_attempts=...``; other query options stay for aio-pika."""
    from qmq_outbox.transports.urls import split_options

    plain, options = split_options(url, RabbitMqTransport, keep_unknown=True)
    return RabbitMqTransport(url=plain, **options)
