"""The transport seam: what the outbox and the consumer need of a message system.

Producer side (the dispatcher and the compensator): ``produce(batch)`` answers one
``Outcome`` per message, in order: a ``ProduceResult`` (``stored``, ``duplicate`` or
``scheduled``), a ``BrokerRejected`` or a ``BrokerUnavailable`` (transient: the row waits
for a later attempt). A transport that stores a batch all or nothing (the qmq broker) may
instead raise one of the two for the whole batch; ``sending.SendPlan`` then splits a
rejected batch to find the culprit. ``refusal`` says what a rejection is about: only one
that names a message may make its row ``dead``; a refusal of the request as such (a token,
a right, a route, a content type) is a configuration error and leaves every row pending.
``Producer`` blocks (thread dispatchers, the compensator), ``AsyncProducer`` runs on the
caller's event loop (asyncio engines).

Consumer side: ``PullClient`` (pull a batch under a lease, ack, ack-and-pull, nack with a
delay and an error; past the last attempt a nack dead-letters), opened per consumer by
``Transport.open_consumer``. ``seq`` identifies a delivery to the client that pulled it:
the qmq broker's subject sequence, JetStream's stream sequence, a RabbitMQ lease number.
The JetStream and RabbitMQ clients are ``LeasingConsumer``s: the surface once, their own
fetch, ack and nack steps below it.

``Transport`` is the configuration object users pass as ``Outbox(transport=...)`` and
``Consumer(transport=...)``; it makes the producers and consumer clients.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import qmq_wire
from qmq_outbox.calls import AckedPull, Position, PullMode, StartAt
from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable, UnsupportedByTransport

Outcome = ProduceResult | BrokerRejected | BrokerUnavailable
Refusal = Literal["message", "unroutable", "configuration"]
UNROUTABLE = "unroutable"
"""The code of a transport's per-message rejection for a message no queue takes (yet)."""
_ABOUT_THE_REQUEST = frozenset({401, 403, 404, 405, 415})


def refusal(error: BrokerRejected) -> Refusal:
    """What ``error`` refuses: the message (its row may go ``dead``), its routing (no
    consumer has bound a queue for its subject yet: retried until an age), or the request as
    such (a configuration error: every row stays pending)."""
    if error.status is None:  # a transport's per-message outcome
        return "unroutable" if error.code == UNROUTABLE else "message"
    if error.status in _ABOUT_THE_REQUEST:
        return "configuration"  # even with a field: a right missing for messages[i].subject
    if error.status == 413 or (error.field or "").startswith("messages["):
        return "message"  # 413 without a field: the batch is too large, split until alone
    return "configuration"


def retry_delay(attempt: int) -> float:
    """Seconds before a nacked message's next attempt when the handler chose no delay: the
    qmq broker's default backoff after failed attempt ``attempt`` (1 s, 5 s, 10 s, 30 s, ...)."""
    table = qmq_wire.DEFAULT_BACKOFF_S
    return float(table[min(max(attempt, 1), len(table)) - 1])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a transport offers beyond storing and delivering messages at least once."""

    dedup: bool
    """Resends of a message id are stored once (within a window)."""
    delay: bool
    """Messages may carry ``deliver_at`` (``publish(delay=...)``)."""
    ordered: bool
    """Ordered subjects and ``@handler(subject, ordered=True)``."""
    broadcast: bool
    """``Consumer(mode="broadcast")``."""
    tag_filter: bool = False
    """Pulls filter by tags on the broker (``@handler(subject, tags=[...])``); without it
    the consumer acks the messages of other tags unrun."""


class Producer(Protocol):
    """Blocking producer side (``BrokerClient`` is one)."""

    def produce(self, messages: Sequence[OutgoingMessage]) -> Sequence[Outcome]: ...


class AsyncProducer(Protocol):
    """asyncio producer side (``AsyncBrokerClient`` is one)."""

    async def produce(self, messages: Sequence[OutgoingMessage]) -> Sequence[Outcome]: ...


class ClosingProducer(Producer, Protocol):
    def close(self) -> None: ...


class ClosingAsyncProducer(AsyncProducer, Protocol):
    async def aclose(self) -> None: ...


class PullClient(Protocol):
    """What the consumer needs of ``AsyncBrokerClient``. ``partition`` is passed to ``ack``
    and ``nack`` only for ordered subjects, so a client for plain subjects may lack it."""

    async def pull(
        self,
        subject: str,
        group: str,
        consumer: str,
        *,
        max_messages: int = ...,
        wait_ms: int = ...,
        mode: PullMode = ...,
        start: Position = ...,
        max_keys: int | None = ...,
    ) -> list[Message]: ...

    async def ack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        partition: int | None = ...,
    ) -> dict[str, Any]: ...

    async def ack_and_pull(
        self,
        subject: str,
        group: str,
        consumer: str,
        ack: Sequence[int],
        *,
        max_messages: int = ...,
        wait_ms: int = ...,
        mode: PullMode = ...,
        start: Position = ...,
    ) -> AckedPull: ...

    async def nack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        delay_ms: int | None = ...,
        error: str | None = ...,
        partition: int | None = ...,
    ) -> dict[str, Any]: ...


async def ack_then_pull(
    client: PullClient,
    subject: str,
    group: str,
    consumer: str,
    ack: Sequence[int],
    **options: Any,
) -> AckedPull:
    """``ack_and_pull`` for a transport whose pull cannot carry acks: the ack, then the pull."""
    answer = await client.ack(subject, group, consumer, ack)
    messages = await client.pull(subject, group, consumer, **options)
    return AckedPull(messages, answer["acked"], answer["unknown"])


class ConsumerClient(PullClient, Protocol):
    """A ``PullClient`` opened by a transport for one consumer; closed by it at the end."""

    async def aclose(self) -> None: ...


class LeasingConsumer(abc.ABC):
    """The ``PullClient`` surface of a transport client that keeps its consumer's leases
    itself (JetStream, RabbitMQ): the signatures once, over three transport steps. The
    group and the consumer are the client's own, so the steps take neither."""

    async def pull(
        self,
        subject: str,
        group: str,
        consumer: str,
        *,
        max_messages: int = 32,
        wait_ms: int = 0,
        mode: PullMode = "shared",
        start: Position = "earliest",
        max_keys: int | None = None,  # ordered subjects only, which these engines lack
    ) -> list[Message]:
        return await self._fetch(subject, max_messages, wait_ms, start)

    ack_and_pull = ack_then_pull  # its pull cannot carry acks: the ack, then the pull

    async def ack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        partition: int | None = None,
    ) -> dict[str, Any]:
        acked, unknown = await self._ack(subject, seqs)
        return {"acked": acked, "unknown": unknown}

    async def nack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        delay_ms: int | None = None,
        error: str | None = None,
        partition: int | None = None,
    ) -> dict[str, Any]:
        retrying, dead = await self._nack(subject, seqs, delay_ms, error)
        return {"retrying": retrying, "dead": dead}

    @abc.abstractmethod
    async def _fetch(
        self, subject: str, max_messages: int, wait_ms: int, start: Position
    ) -> list[Message]:
        """Lease up to ``max_messages`` of ``subject``, waiting up to ``wait_ms`` for one
        (``start``: see ``named_start``)."""

    @abc.abstractmethod
    async def _ack(self, subject: str, seqs: Sequence[int]) -> tuple[int, list[int]]:
        """End the leases of ``seqs``: how many were acked, and the seqs not (or no longer)
        held."""

    @abc.abstractmethod
    async def _nack(
        self, subject: str, seqs: Sequence[int], delay_ms: int | None, error: str | None
    ) -> tuple[int, int]:
        """Give ``seqs`` back for a later attempt (``delay_ms``, else the backoff by attempt),
        or dead-letter those at their last: how many retry, how many went dead."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """A message a group gave up on, as a transport keeps it."""

    id: str
    subject: str
    group: str
    attempts: int
    error: str | None
    body: bytes
    headers: dict[str, str]


def named_start(start: Position, transport: str) -> StartAt:
    """``earliest`` or ``latest``: a group's start at a seq or a time is the qmq broker's
    alone (``Consumer`` refuses it for other transports when it is made)."""
    if start == "earliest" or start == "latest":
        return start
    raise UnsupportedByTransport(f"{transport} starts a group at earliest or latest only")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerSpec:
    """What a transport needs to open a consumer's client."""

    group: str
    consumer_id: str
    subjects: tuple[str, ...]
    start: Position
    capacity: int
    """The most messages the consumer holds at once (running plus prefetched)."""
    connections: int
    """Requests the consumer may have in flight at once (pullers, nacks, the acker)."""


@runtime_checkable
class Transport(Protocol):
    """A message system the outbox and the consumer can use (``transports.from_url``)."""

    @property
    def url(self) -> str:
        """Where it is, for log lines (password masked by the caller)."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    def producer(self) -> ClosingProducer:
        """A blocking producer; the caller closes it."""
        ...

    def async_producer(self) -> ClosingAsyncProducer:
        """A producer for the running event loop (it connects on first use there)."""
        ...

    async def open_consumer(self, spec: ConsumerSpec) -> ConsumerClient:
        """A connected client for one consumer; its subjects' storage (a stream consumer,
        a queue) is set up by its first pull at the latest."""
        ...

    def check(self) -> None:
        """Raise ``BrokerUnavailable`` unless the transport can be reached now."""
        ...
