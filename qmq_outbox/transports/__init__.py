"""Transports: the message systems the outbox and the consumer can use (docs/transports.md).

``QmqTransport`` (the qmq broker, the default), ``JetStreamTransport`` (NATS JetStream, the
``nats`` extra) and ``RabbitMqTransport`` (RabbitMQ, the ``rabbitmq`` extra); ``from_url``
picks one by URL scheme. The JetStream and RabbitMQ modules import their libraries only
when used, so this package imports without the extras.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qmq_outbox.lazy import lazy_attributes
from qmq_outbox.transports.base import (
    AsyncProducer,
    Capabilities,
    ConsumerClient,
    ConsumerSpec,
    DeadLetter,
    Outcome,
    Producer,
    PullClient,
    Transport,
)
from qmq_outbox.transports.qmq import QmqTransport
from qmq_outbox.transports.urls import from_url

if TYPE_CHECKING:
    from qmq_outbox.transports.jetstream import JetStreamTransport
    from qmq_outbox.transports.rabbitmq import RabbitMqTransport

_LAZY = {
    "qmq_outbox.transports.jetstream": ("JetStreamTransport",),
    "qmq_outbox.transports.rabbitmq": ("RabbitMqTransport",),
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "AsyncProducer",
    "Capabilities",
    "ConsumerClient",
    "ConsumerSpec",
    "DeadLetter",
    "JetStreamTransport",
    "Outcome",
    "Producer",
    "PullClient",
    "QmqTransport",
    "RabbitMqTransport",
    "Transport",
    "from_url",
]
