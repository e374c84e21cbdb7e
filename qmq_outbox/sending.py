"""Produce a list of messages in broker-sized batches, isolating permanent rejections.

The qmq broker stores a batch all or nothing, so one poison message would block its whole
batch: a rejected batch is split in halves until the rejected messages stand alone. A
transport that stores message by message (JetStream, RabbitMQ) answers each message's
outcome instead (``transports.base``). A transient failure (``BrokerUnavailable``), of a
batch or of one message, stops the send, and so does a refusal of the request as such (a
configuration error: ``transports.base.refusal``); the rest stays for a later attempt. A
message no queue takes yet (``unroutable``) is set aside, neither sent nor rejected.

``SendPlan`` is the whole logic and does no I/O: it says which batch to send next and takes
each batch's outcome. ``send`` and ``send_async`` are its blocking and asyncio drivers;
the dispatcher and the compensator use them, with any transport's producer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TypedDict, Unpack

from qmq_outbox.envelope import OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable
from qmq_outbox.transports.base import AsyncProducer, Outcome, Producer, refusal

MAX_BATCH = 1000
MAX_BATCH_BYTES = 4 * 1024 * 1024
Failure = BrokerUnavailable | BrokerRejected


class Limits(TypedDict, total=False):
    """A send's batch limits (``SendPlan``'s defaults where left out)."""

    max_count: int
    max_bytes: int


@dataclasses.dataclass(slots=True)
class SendReport:
    """What happened to each message of one ``send``. ``error`` stopped it: the broker was
    unavailable, or refused the request as such (``configured`` is then False)."""

    results: list[ProduceResult] = dataclasses.field(default_factory=list)
    rejected: list[tuple[OutgoingMessage, BrokerRejected]] = dataclasses.field(default_factory=list)
    unroutable: list[tuple[OutgoingMessage, BrokerRejected]] = dataclasses.field(
        default_factory=list
    )
    unsent: list[OutgoingMessage] = dataclasses.field(default_factory=list)
    error: Failure | None = None

    @property
    def configured(self) -> bool:
        """False when the broker refused the request itself (a token, a right, a route)."""
        return not isinstance(self.error, BrokerRejected)


def chunks(
    messages: Sequence[OutgoingMessage], *, max_count: int, max_bytes: int
) -> Iterator[list[OutgoingMessage]]:
    """Consecutive batches of at most ``max_count`` messages and about ``max_bytes`` of body."""
    batch: list[OutgoingMessage] = []
    size = 0
    for message in messages:
        if batch and (len(batch) >= max_count or size + len(message.body) > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(message)
        size += len(message.body)
    if batch:
        yield batch


class SendPlan:
    """The batches of one send, in order: ``next_batch()`` until None, each answered with
    ``answered(batch, outcomes)`` or ``failed(batch, error)``; then ``report``."""

    def __init__(
        self,
        messages: Sequence[OutgoingMessage],
        *,
        max_count: int = MAX_BATCH,
        max_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        self.report = SendReport()
        self._todo = list(chunks(messages, max_count=max_count, max_bytes=max_bytes))
        self._todo.reverse()  # a stack: the next batch is last

    def next_batch(self) -> list[OutgoingMessage] | None:
        """The batch to send now; None when done (after a transient failure, what is left
        goes to ``report.unsent``)."""
        if self.report.error is not None:
            while self._todo:
                self.report.unsent.extend(self._todo.pop())
        return self._todo.pop() if self._todo else None

    def answered(self, batch: list[OutgoingMessage], outcomes: Sequence[Outcome]) -> None:
        """Each message's outcome: stored (or duplicate, scheduled), rejected, unroutable,
        or transient (which stops the send, as a transient failure of a batch does)."""
        report = self.report
        for message, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, ProduceResult):
                report.results.append(outcome)
            elif isinstance(outcome, BrokerUnavailable):
                report.error = outcome
                report.unsent.append(message)
            elif (kind := refusal(outcome)) == "message":
                report.rejected.append((message, outcome))
            elif kind == "unroutable":
                report.unroutable.append((message, outcome))
            else:
                report.error = outcome
                report.unsent.append(message)

    def failed(self, batch: list[OutgoingMessage], error: Failure) -> None:
        """A transient error, or a refusal of the request as such, stops the send; a
        rejection of a message splits the batch until the rejected message stands alone."""
        if isinstance(error, BrokerUnavailable) or refusal(error) != "message":
            self.report.error = error
            self.report.unsent.extend(batch)
        elif len(batch) == 1:
            self.report.rejected.append((batch[0], error))
        else:
            middle = len(batch) // 2
            self._todo.extend([batch[middle:], batch[:middle]])


def send(
    client: Producer, messages: Sequence[OutgoingMessage], **limits: Unpack[Limits]
) -> SendReport:
    """Send ``messages`` with a blocking producer (a ``BrokerClient``, or a transport's)."""
    plan = SendPlan(messages, **limits)
    while (batch := plan.next_batch()) is not None:
        try:
            plan.answered(batch, client.produce(batch))
        except (BrokerUnavailable, BrokerRejected) as exc:
            plan.failed(batch, exc)
    return plan.report


async def send_async(
    client: AsyncProducer, messages: Sequence[OutgoingMessage], **limits: Unpack[Limits]
) -> SendReport:
    """``send`` with an asyncio producer."""
    plan = SendPlan(messages, **limits)
    while (batch := plan.next_batch()) is not None:
        try:
            plan.answered(batch, await client.produce(batch))
        except (BrokerUnavailable, BrokerRejected) as exc:
            plan.failed(batch, exc)
    return plan.report
