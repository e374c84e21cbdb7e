"""Test your handlers and publishers without a broker: an in-memory broker for the real clients.

    from qmq_outbox.testing import InMemoryBroker, StepClock

    clock = StepClock()
    broker = InMemoryBroker(ack_timeout=30, clock=clock)
    with broker.client() as client:
        ...  # produce, pull, ack, nack as against a real broker
        clock.advance(31)  # leases expire without sleeping

Ordered subjects work too, route changes included (``qmq_outbox/testing/ordered.py`` says
what is kept and what is left out). Test controls on the broker: switches (``available``,
``lose_responses``, ``forbidden_subjects``, ``fail(...)``) and what it saw (``stored``,
``received(...)``, ``acked_seqs``, ``dead_seqs``, ``most_leased``). ``docs/testing.md``
shows them with a consumer and an outbox.
"""

from __future__ import annotations

from qmq_outbox.testing.broker import BASE_URL, InMemoryBroker
from qmq_outbox.testing.clock import StepClock

__all__ = ["BASE_URL", "InMemoryBroker", "StepClock"]
