"""Publish a batch message by message, concurrently, keeping each key's order.

For transports that store message by message (JetStream, RabbitMQ). Messages of one
(subject, key) go one after another in batch order (outbox id order), and once one of them
is not stored the rest of its key are not sent (they answer ``BrokerUnavailable``: their
rows wait for the compensator, which sends them after it, docs/outbox.md "Per-key order").
Everything else goes at once, at most ``in_flight`` publishes at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from qmq_outbox.envelope import OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable
from qmq_outbox.transports.base import Outcome

IN_FLIGHT = 256


async def publish_in_key_order(
    messages: Sequence[OutgoingMessage],
    publish: Callable[[OutgoingMessage], Awaitable[Outcome]],
    *,
    in_flight: int = IN_FLIGHT,
) -> list[Outcome]:
    """One outcome per message of ``messages``, in order, each from ``publish``."""
    outcomes: list[Outcome | None] = [None] * len(messages)
    chains: dict[object, list[int]] = {}
    for index, message in enumerate(messages):
        chain = (message.subject, message.key) if message.key is not None else index
        chains.setdefault(chain, []).append(index)
    room = asyncio.Semaphore(max(1, in_flight))

    async def run(indexes: list[int]) -> None:
        for position, index in enumerate(indexes):
            async with room:
                outcome = await publish(messages[index])
            outcomes[index] = outcome
            if not isinstance(outcome, ProduceResult | BrokerRejected):
                held = BrokerUnavailable(f"held back: an earlier one of its key failed ({outcome})")
                for later in indexes[position + 1 :]:
                    outcomes[later] = held
                return

    await asyncio.gather(*(run(indexes) for indexes in chains.values()))
    done = [outcome for outcome in outcomes if outcome is not None]
    assert len(done) == len(messages)  # every chain ran to its end
    return done
