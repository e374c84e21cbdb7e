"""qmq-outbox: transactional outbox producer and idempotent consumer SDK."""

from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.compensator import Compensator
from qmq_outbox.consumer import Consumer
from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
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
)
from qmq_outbox.idempotent import IdempotentStore
from qmq_outbox.outbox import Outbox
from qmq_outbox.serializers import JsonSerializer, Serializer

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
    "JsonSerializer",
    "Message",
    "Outbox",
    "OutboxStoreError",
    "OutgoingMessage",
    "ProduceResult",
    "QmqError",
    "RetryLater",
    "SerializationError",
    "Serializer",
]
