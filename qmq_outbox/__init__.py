"""qmq-outbox: transactional outbox producer and idempotent consumer SDK."""

from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
from qmq_outbox.errors import (
    BrokerError,
    BrokerRejected,
    BrokerUnavailable,
    ConfigurationError,
    QmqError,
)

__all__ = [
    "AsyncBrokerClient",
    "BrokerClient",
    "BrokerError",
    "BrokerRejected",
    "BrokerUnavailable",
    "ConfigurationError",
    "Message",
    "OutgoingMessage",
    "ProduceResult",
    "QmqError",
]
