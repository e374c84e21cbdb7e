"""Produce a list of messages in broker-sized batches, isolating permanent rejections.

The broker stores a batch all or nothing, so one poison message would block its whole batch:
a rejected batch is split in halves until the rejected messages stand alone. A transient
failure (``BrokerUnavailable``) stops the send; the rest stays for a later attempt.
Shared by the dispatcher and the compensator; ``send``/``send_async`` are thin twins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.envelope import OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable

MAX_BATCH = 1000
MAX_BATCH_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(slots=True)
class SendReport:
    """What happened to each message of one ``send``."""

    results: list[ProduceResult] = dataclasses.field(default_factory=list)
    rejected: list[tuple[OutgoingMessage, BrokerRejected]] = dataclasses.field(default_factory=list)
    unsent: list[OutgoingMessage] = dataclasses.field(default_factory=list)
    error: BrokerUnavailable | None = None


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


def _halves(batch: list[OutgoingMessage]) -> list[list[OutgoingMessage]]:
    middle = len(batch) // 2
    return [batch[:middle], batch[middle:]]


def send(
    client: BrokerClient,
    messages: Sequence[OutgoingMessage],
    *,
    max_count: int = MAX_BATCH,
    max_bytes: int = MAX_BATCH_BYTES,
) -> SendReport:
    report = SendReport()
    todo = list(chunks(messages, max_count=max_count, max_bytes=max_bytes))
    todo.reverse()
    while todo:
        batch = todo.pop()
        if report.error is not None:
            report.unsent.extend(batch)
            continue
        try:
            report.results.extend(client.produce(batch))
        except BrokerUnavailable as exc:
            report.error = exc
            report.unsent.extend(batch)
        except BrokerRejected as exc:
            if len(batch) == 1:
                report.rejected.append((batch[0], exc))
            else:
                todo.extend(reversed(_halves(batch)))
    return report


async def send_async(
    client: AsyncBrokerClient,
    messages: Sequence[OutgoingMessage],
    *,
    max_count: int = MAX_BATCH,
    max_bytes: int = MAX_BATCH_BYTES,
) -> SendReport:
    report = SendReport()
    todo = list(chunks(messages, max_count=max_count, max_bytes=max_bytes))
    todo.reverse()
    while todo:
        batch = todo.pop()
        if report.error is not None:
            report.unsent.extend(batch)
            continue
        try:
            report.results.extend(await client.produce(batch))
        except BrokerUnavailable as exc:
            report.error = exc
            report.unsent.extend(batch)
        except BrokerRejected as exc:
            if len(batch) == 1:
                report.rejected.append((batch[0], exc))
            else:
                todo.extend(reversed(_halves(batch)))
    return report
