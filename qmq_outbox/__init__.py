"""qmq-outbox: transactional outbox producer and idempotent consumer SDK.

The errors are imported with the package; everything else when first used, so that a
``qmq`` subcommand (or a program that needs only the client) does not pay for importing
the compensator's scheduler, the consumer and SQLAlchemy's ORM up front.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qmq_outbox.errors import (
    BrokerError,
    BrokerRejected,
    BrokerUnavailable,
    ClaimHeld,
    ConfigurationError,
    ConsumerCrashed,
    ConsumerError,
    DuplicateMessage,
    IdempotentStoreError,
    InvalidMessage,
    OutboxStoreError,
    QmqError,
    RetryLater,
    SerializationError,
    UnsupportedByTransport,
)
from qmq_outbox.lazy import lazy_attributes

if TYPE_CHECKING:
    from qmq_outbox.client import AsyncBrokerClient, BrokerClient
    from qmq_outbox.compensator import Compensator
    from qmq_outbox.consumer import Consumer
    from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
    from qmq_outbox.idempotent import IdempotentStore
    from qmq_outbox.outbox import Outbox
    from qmq_outbox.serializers import JsonSerializer, Serializer
    from qmq_outbox.transports import JetStreamTransport, QmqTransport, RabbitMqTransport

_LAZY = {
    "qmq_outbox.client": ("AsyncBrokerClient", "BrokerClient"),
    "qmq_outbox.compensator": ("Compensator",),
    "qmq_outbox.consumer": ("Consumer",),
    "qmq_outbox.envelope": ("Message", "OutgoingMessage", "ProduceResult"),
    "qmq_outbox.idempotent": ("IdempotentStore",),
    "qmq_outbox.outbox": ("Outbox",),
    "qmq_outbox.serializers": ("JsonSerializer", "Serializer"),
    "qmq_outbox.transports": ("JetStreamTransport", "QmqTransport", "RabbitMqTransport"),
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "AsyncBrokerClient",
    "BrokerClient",
    "BrokerError",
    "BrokerRejected",
    "BrokerUnavailable",
    "ClaimHeld",
    "Compensator",
    "ConfigurationError",
    "Consumer",
    "ConsumerCrashed",
    "ConsumerError",
    "DuplicateMessage",
    "IdempotentStore",
    "IdempotentStoreError",
    "InvalidMessage",
    "JetStreamTransport",
    "JsonSerializer",
    "Message",
    "Outbox",
    "OutboxStoreError",
    "OutgoingMessage",
    "ProduceResult",
    "QmqError",
    "QmqTransport",
    "RabbitMqTransport",
    "RetryLater",
    "SerializationError",
    "Serializer",
    "UnsupportedByTransport",
]
