"""Serving one pull for the scheduler: decide on the event loop, read on a worker thread.

The decision (expire leases, choose seqs, append the LEASE record) runs on the loop with
no await inside, so group state changes only on the loop thread and in log order, exactly
as replay will rebuild it; the seqs are leased before they are read, so nothing else can
choose them meanwhile. The reads (``pread``, CRC, decode, wire form) run on the read pool
and touch only immutable inputs: positions resolved on the loop and the thread-safe
``SegmentReader``. Unreadable records go to the dead letters, as before, on the loop.

``read_delays`` adds a sleep before each batch read of a (subject, group), on its worker
thread: it stands in for a cold disk in benchmarks and tests (``--debug-read-delay-ms``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from broker.errors import CorruptRecord, StorageError
from broker.format import ActionRecord, ActionType, MessageRecord, read_frame_at
from broker.groups import DeliveryState, Group, Policy
from broker.messages import to_wire
from broker.metrics import BrokerMetrics
from broker.scheduling import Clock, Outcome, PullRequest
from broker.storage.segments import SegmentReader
from broker.subjects import SubjectLog

logger = logging.getLogger(__name__)
_MAX_RUN = 4 * 1024 * 1024  # bytes read by one pread at most


@dataclasses.dataclass(frozen=True, slots=True)
class _Batch:
    """What a decision leased: seqs, their attempt numbers and where they are stored."""

    seqs: list[int]
    attempts: list[int]
    positions: list[tuple[int, int, int]]  # (segment, offset, length)
    now_us: int


class PullService:
    """The scheduler's processor for ``POST /v1/pull``."""

    def __init__(
        self,
        *,
        groups: dict[tuple[str, str], Group],
        subjects: dict[str, SubjectLog],
        record: Callable[[ActionRecord], None],
        reader: SegmentReader,
        policy: Policy,
        now_us: Callable[[], int],
        clock: Clock,
        executor: Executor,
        metrics: BrokerMetrics,
        read_delays: Mapping[tuple[str, str], float] | None = None,
    ) -> None:
        self._groups = groups
        self._subjects = subjects
        self._record = record
        self._reader = reader
        self._policy = policy
        self._now_us = now_us
        self._clock = clock
        self._executor = executor
        self._metrics = metrics
        self._read_delays = dict(read_delays or {})

    async def __call__(self, requests: Sequence[PullRequest]) -> list[Outcome]:
        """Decide every request in order, read all their records in one hand-off."""
        loop = asyncio.get_running_loop()
        outcomes: list[Outcome | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        while todo:
            reads: list[tuple[int, _Batch, float]] = []
            for index in todo:
                request = requests[index]
                state = self._groups[(request.subject, request.group)].states[request.key]
                batch = self._decide(request, state)
                if batch is None:
                    outcomes[index] = Outcome(None, wake_at=self._wake_at(state))
                else:
                    delay = self._read_delays.get((request.subject, request.group), 0.0)
                    reads.append((index, batch, delay))
            if not reads:
                break
            results = await loop.run_in_executor(
                self._executor, _read_batches, self._reader, [(b, d) for _, b, d in reads]
            )
            todo = []
            for (index, batch, _), (messages, unreadable) in zip(reads, results, strict=True):
                if unreadable:
                    self._bury(requests[index], batch.now_us, unreadable)
                if messages:
                    self._metrics.pulled.inc(len(messages))
                    outcomes[index] = Outcome(messages)
                else:
                    todo.append(index)  # all it chose was unreadable (now dead): choose again
        return [o if o is not None else Outcome(None) for o in outcomes]

    def _decide(self, request: PullRequest, state: DeliveryState) -> _Batch | None:
        now = self._now_us()
        for kind, seqs, fields in state.expire(now_us=now, policy=self._policy):
            self._record(_action(kind, now, request, seqs, fields))
        log = self._subjects[request.subject]
        if state.cursor < log.first_seq:
            state.cursor = log.first_seq  # retention removed what this group never read
        while True:
            seqs, attempts = state.choose(
                limit=request.max_messages, now_us=now, end_seq=log.end_seq
            )
            gone = [seq for seq in seqs if seq < log.first_seq]
            if not gone:
                break
            # Retries of messages that retention deleted: dead, saying why, then choose again.
            error = "removed by retention before it was acknowledged"
            self._record(_action(ActionType.DEAD, now, request, gone, {"error": error}))
        if not seqs:
            return None
        positions = []
        for seq in seqs:
            segment, length, offset, _, _ = log.raw(seq)
            positions.append((segment, offset, length))
        deadline = now + self._policy.ack_timeout_us
        fields = {"consumer": request.consumer, "deadline": deadline, "attempts": attempts}
        self._record(_action(ActionType.LEASE, now, request, seqs, fields))
        return _Batch(seqs=seqs, attempts=attempts, positions=positions, now_us=now)

    def _bury(self, request: PullRequest, now: int, unreadable: list[tuple[int, str]]) -> None:
        for seq, error in unreadable:
            logger.error(
                "unreadable message not served",
                extra={
                    "action": "broker.unreadable",
                    "subject": request.subject,
                    "seq": seq,
                    "error": error,
                },
            )
        seqs = [seq for seq, _ in unreadable]
        self._record(_action(ActionType.DEAD, now, request, seqs, {"error": "unreadable record"}))

    def _wake_at(self, state: DeliveryState) -> float | None:
        """The scheduler-clock time of the group's next retry or lease expiry, if any."""
        wakeup = state.next_wakeup_us()
        if wakeup is None:
            return None
        delay = max((wakeup - self._now_us()) / 1_000_000, 0.001)
        return self._clock.now() + delay


def _read_batches(
    reader: SegmentReader, batches: list[tuple[_Batch, float]]
) -> list[tuple[list[dict[str, Any]], list[tuple[int, str]]]]:
    """Runs on a read-pool thread: each batch's records in wire form, and the failures."""
    return [_read_batch(reader, batch, delay_s) for batch, delay_s in batches]


def _read_batch(
    reader: SegmentReader, batch: _Batch, delay_s: float
) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    if delay_s > 0:
        time.sleep(delay_s)
    out: list[dict[str, Any]] = []
    unreadable: list[tuple[int, str]] = []
    payloads = _payloads(reader, batch.positions)
    for seq, attempt, (segment, offset, _), payload in zip(
        batch.seqs, batch.attempts, batch.positions, payloads, strict=True
    ):
        try:
            if isinstance(payload, BaseException):
                raise payload
            record = MessageRecord.decode(payload, path=f"messages/{segment}", offset=offset)
        except (StorageError, CorruptRecord, OSError) as exc:
            unreadable.append((seq, str(exc)))
            continue
        out.append(to_wire(record, attempt=attempt))
    return out, unreadable


def _payloads(
    reader: SegmentReader, positions: list[tuple[int, int, int]]
) -> list[bytes | BaseException]:
    """Frame payloads, reading each run of adjacent frames with one ``pread``.

    A batch of a subject's consecutive messages usually sits back to back in one segment;
    one system call per run instead of one per frame also means one GIL hand-off per run.
    """
    out: list[bytes | BaseException] = []
    i = 0
    while i < len(positions):
        segment, start, length = positions[i]
        j = i + 1
        end = start + length
        while j < len(positions) and positions[j][0] == segment and positions[j][1] == end:
            if end + positions[j][2] - start > _MAX_RUN:
                break
            end += positions[j][2]
            j += 1
        if j - i == 1:
            try:
                out.append(reader.read(segment, start, length))
            except (StorageError, CorruptRecord, OSError) as exc:
                out.append(exc)
        else:
            out.extend(_run(reader, positions[i:j], start, end))
        i = j
    return out


def _run(
    reader: SegmentReader, positions: list[tuple[int, int, int]], start: int, end: int
) -> list[bytes | BaseException]:
    path = f"messages/{positions[0][0]}"
    try:
        data = memoryview(os.pread(reader._fd(positions[0][0]), end - start, start))
    except (StorageError, OSError) as exc:
        return [exc] * len(positions)
    out: list[bytes | BaseException] = []
    for _, offset, length in positions:
        try:
            out.append(
                read_frame_at(
                    data[offset - start : offset - start + length], offset=offset, path=path
                )
            )
        except CorruptRecord as exc:
            out.append(exc)
    return out


def _action(
    kind: ActionType,
    now: int,
    request: PullRequest,
    seqs: list[int],
    fields: dict[str, Any],
) -> ActionRecord:
    return ActionRecord(
        type=kind,
        at_us=now,
        subject=request.subject,
        group=request.group,
        state=request.key,
        seqs=tuple(seqs),
        fields=fields,
    )
