"""A pull request as the scheduler sees it, and what serving it may produce."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, Protocol

TIMER_SLACK_S = 0.001  # timers fire on a millisecond grid; treat "due within 1 ms" as due


class PullStatus(enum.Enum):
    QUEUED = "queued"  # in the actor's mailbox, waiting for a worker
    RUNNING = "running"  # being served by a worker
    PARKED = "parked"  # found nothing; long-polling until new data or its wait ends
    DONE = "done"  # answered, failed or cancelled


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class QueuedPull:
    """One ``POST /v1/pull``; times are on the scheduler's clock (monotonic seconds).

    ``wait_until`` ends the long poll (then an empty answer is right); ``deadline`` is the
    latest time a worker may start on it (then it is answered 503, never dropped). Until
    ``linger_until`` (never after ``wait_until``) it is not answered with fewer than
    ``min_messages``: it waits for a fuller batch.
    """

    subject: str
    group: str
    key: str  # delivery-state key: the consumer in broadcast mode, "" in shared mode
    consumer: str
    max_messages: int
    arrived: float
    wait_until: float
    deadline: float
    future: asyncio.Future[list[Any]]
    min_messages: int = 1
    max_keys: int = 1  # ordered mode: a partition's keys with a message in flight at once
    linger_until: float = 0.0
    records: bool = False  # answered with the records as stored (``qmq_wire.records``)
    status: PullStatus = PullStatus.QUEUED
    timed_out: bool = False  # its wait ended while parked: answer now, data or not
    queued_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.status is PullStatus.DONE or self.future.done()


@dataclasses.dataclass(frozen=True, slots=True)
class PullOutcome:
    """What one serving step found: messages to answer with, or nothing yet.

    ``wake_at`` (scheduler clock) says when the group next has something due without a new
    message (a retry, an expiring lease, the end of a linger), so a parked request can be
    resumed then.
    """

    messages: list[Any] | None
    wake_at: float | None = None
    lingering: bool = False  # messages were there, fewer than the request's min


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """What serving a batch of requests gave: one outcome per request, in order, and
    ``work_s``, the CPU seconds it cost on the loop and on the read thread.

    The work, not the wall time, is what the group is charged: a batch's wall time also
    holds its waits for the read pool and for the GIL, which grow with everything else the
    broker does (a lone small pull waits as long for its hand-off as a batch of 64).
    """

    outcomes: list[PullOutcome]
    work_s: float


class Processor(Protocol):
    """Serves a batch of one actor's requests, in order; called on the loop by a worker.

    Batching lets one hand-off to the read pool serve several requests.
    """

    async def __call__(self, requests: Sequence[QueuedPull]) -> Served: ...
