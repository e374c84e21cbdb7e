"""Test your handlers and publishers without a broker: an in-memory broker for the real clients.

    from qmq_outbox.testing import InMemoryBroker, StepClock

    clock = StepClock()
    broker = InMemoryBroker(ack_timeout=30, clock=clock)
    with broker.client() as client:
        ...  # produce, pull, ack, nack as against a real broker
        clock.advance(31)  # leases expire without sleeping

``docs/testing.md`` shows it with a consumer and an outbox.
"""

from __future__ import annotations

from qmq_outbox.testing.broker import BASE_URL, InMemoryBroker
from qmq_outbox.testing.clock import StepClock

__all__ = ["BASE_URL", "InMemoryBroker", "StepClock"]
