"""The consumer SDK: ``Consumer``, ``RetryLater`` and the handler protocols."""

from qmq_outbox.consumer.config import ConsumerStats
from qmq_outbox.consumer.core import Consumer
from qmq_outbox.consumer.handlers import AsyncSessionHandler, MessageHandler, SessionHandler
from qmq_outbox.errors import ConsumerCrashed, ConsumerError, RetryLater

__all__ = [
    "AsyncSessionHandler",
    "Consumer",
    "ConsumerCrashed",
    "ConsumerError",
    "ConsumerStats",
    "MessageHandler",
    "RetryLater",
    "SessionHandler",
]
