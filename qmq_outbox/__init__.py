"""qmq-outbox: transactional outbox producer and idempotent consumer SDK."""

from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.compensator import Compensator
from qmq_outbox.consumer import Consumer, RetryLater
from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
from qmq_outbox.errors import (
    BrokerError,
    BrokerRejected,
    BrokerUnavailable,
    ConfigurationError,
    QmqError,
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
    "Compensator",
    "ConfigurationError",
    "Consumer",
    "IdempotentStore",
    "JsonSerializer",
    "Message",
    "Outbox",
    "OutgoingMessage",
    "ProduceResult",
    "QmqError",
    "RetryLater",
    "Serializer",
]
