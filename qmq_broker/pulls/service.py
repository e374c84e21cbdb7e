"""Serving one pull for the scheduler: decide on the event loop, then read.

The decision (expire leases, choose seqs, append the LEASE record) runs on the loop with
no await inside, so group state changes only on the loop thread and in log order, exactly
as replay will rebuild it; the seqs are leased before they are read, so nothing else can
choose them meanwhile. The reads (``qmq_broker.pulls.reads``) touch only immutable inputs:
records in the page cache are read on the loop; records on disk are read ahead by the
kernel while the pull waits on the loop, and read there once they have arrived; what has
not arrived after ``readahead_wait_s`` is read on the read pool. Unreadable records go to
the dead letters, on the loop.

A group with a tag filter reads before it decides: from its cursor, a window of records is
read (``_scan``: the same read path) and the decision then leases only the matches, the
LEASE record carrying the cursor past the skipped ones (``skip_to``, ``filtered``), so a
skipped message costs the group no lease, no ack and no record of its own. A window with no
match still moves the cursor, with a LEASE of no seqs. The matches are read a second time
for the answer, from the page cache the scan just filled.

Why not hand every cold read to a thread: a read thread must take the GIL to start, and
again after its system call, and on a loop busy serving other groups each take waits up to
the interpreter's switch interval; waiting on the loop costs a cold group nothing of the
kind.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, cast

from qmq_broker.actions import ActionLog, action
from qmq_broker.clock import Clock
from qmq_broker.format.actions import ActionRecord, ActionType
from qmq_broker.groups import DeliveryState, GroupTable, Policy
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.pulls.ordered import OrderedPulls
from qmq_broker.pulls.reads import Batch, Read, read_ahead, read_batches, read_cached
from qmq_broker.pulls.request import TIMER_SLACK_S, PullOutcome, QueuedPull, Served
from qmq_broker.storage.segments import CACHED_READS, NotCached, SegmentReader
from qmq_broker.subjects import SubjectLog, SubjectTable
from qmq_wire.rules import tags_match

if TYPE_CHECKING:
    from qmq_wire import PulledMessageJson

logger = logging.getLogger(__name__)


class _Linger:
    """What ``_decide`` returns for a pull that found fewer messages than its ``min``
    while it may still wait for more (its ``linger_until``)."""


LINGER = _Linger()


class _More:
    """What ``_decide_filtered`` returns when its looks ran out before a match or the end:
    the pull goes on after other groups had their turn (``SCAN_LOOKS``)."""


MORE = _More()

# How often a pull waiting for read-ahead records looks again: soon (an SSD delivers in
# well under a millisecond), then less and less often.
FIRST_LOOK_S = 0.0005
LONGEST_LOOK_S = 0.008
SCAN_WINDOW = 512  # records a filtered group reads per look ahead of its cursor
SCAN_LOOKS = 64  # looks one decision may take before it yields to other groups


class PullService:
    """The scheduler's processor for ``POST /v1/pull``."""

    def __init__(
        self,
        *,
        groups: GroupTable,
        subjects: SubjectTable,
        actions: ActionLog,
        reader: SegmentReader,
        policy: Policy,
        clock: Clock,
        executor: Executor,
        metrics: BrokerMetrics,
        read_delays: Mapping[tuple[str, str], float] | None = None,
        ordered: OrderedPulls | None = None,
        readahead_wait_s: float = 0.05,
    ) -> None:
        self._groups = groups
        self._subjects = subjects
        self._record = actions.record
        self._reader = reader
        self._policy = policy
        self._clock = clock
        self._executor = executor
        self._metrics = metrics
        self._read_delays = dict(read_delays or {})
        self._ordered = ordered
        self._readahead_wait_s = readahead_wait_s if CACHED_READS else 0.0

    async def __call__(self, requests: Sequence[QueuedPull]) -> Served:
        """Decide every request in order, read all their records in one go; the work is
        this thread's CPU time outside the awaits plus the reads'."""
        work = 0.0
        began = time.thread_time()
        outcomes: list[PullOutcome | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        while todo:
            reads: list[tuple[int, Batch, float]] = []
            for index in todo:
                request = requests[index]
                delay = self._read_delays.get((request.subject, request.group), 0.0)
                if self._ordered is not None and self._ordered.ordered(request.subject):
                    batches, wake_at = self._ordered.decide(request)
                    if not batches:
                        outcomes[index] = PullOutcome(None, wake_at=wake_at)
                    reads.extend((index, batch, delay) for batch in batches)
                    continue
                group = self._groups[(request.subject, request.group)]
                state = group.states[request.key]
                if group.tags:
                    work += time.thread_time() - began
                    batch, scan_work = await self._decide_filtered(request, state, group.tags)
                    work += scan_work
                    began = time.thread_time()
                else:
                    batch = self._decide(request, state)
                if isinstance(batch, _More):  # looked far without a match: on in a moment
                    outcomes[index] = PullOutcome(None, wake_at=self._clock.now())
                elif isinstance(batch, _Linger):
                    # fewer than its min: back when the linger ends, or with new data
                    wake_at = min(self._wake_at(state) or math.inf, request.linger_until)
                    outcomes[index] = PullOutcome(None, wake_at=wake_at, lingering=True)
                elif batch is None:
                    outcomes[index] = PullOutcome(None, wake_at=self._wake_at(state))
                else:
                    reads.append((index, batch, delay))
            if not reads:
                break
            work += time.thread_time() - began
            results, read_work = await self._read([(batch, delay) for _, batch, delay in reads])
            began = time.thread_time()
            work += read_work
            served: dict[int, list[Any]] = {}
            for (index, batch, _), (messages, unreadable) in zip(reads, results, strict=True):
                if unreadable:
                    self._bury(requests[index], batch, unreadable)
                served.setdefault(index, []).extend(messages)
            todo = []
            for index, messages in served.items():
                if messages:
                    self._metrics.pulled.inc(len(messages))
                    outcomes[index] = PullOutcome(messages)
                else:
                    todo.append(index)  # all it chose was unreadable (now dead): choose again
        work += time.thread_time() - began
        return Served([o if o is not None else PullOutcome(None) for o in outcomes], work)

    async def _read(self, batches: list[tuple[Batch, float]]) -> tuple[list[Read], float]:
        """The batches' records, and the CPU seconds reading them took: on the loop when
        they are in the page cache or arrive there within ``readahead_wait_s`` of asking
        the kernel for them, else on a read thread (a cold record there blocks only that
        thread). A read delay (``--debug-read-delay-ms``) stands in for the disk: waited
        on the loop before the read when reading ahead, slept on the read thread when not.
        """
        plain = [batch for batch, _ in batches]
        delay = max(d for _, d in batches)
        work = 0.0
        if self._readahead_wait_s > 0 or not delay:
            if delay:
                await asyncio.sleep(delay)
                batches = [(batch, 0.0) for batch in plain]  # waited: not again on a thread
            cached, work = await self._read_on_loop(plain)
            if cached is not None:
                return cached, work
        results, read_work = await asyncio.get_running_loop().run_in_executor(
            self._executor, read_batches, self._reader, batches
        )
        return results, work + read_work

    async def _read_on_loop(self, batches: list[Batch]) -> tuple[list[Read] | None, float]:
        """The batches' records from the page cache, and the CPU seconds it took; after a
        miss, the kernel is asked to read them ahead and the cache is looked at again
        until ``readahead_wait_s`` has passed (the last look at that deadline); ``None``
        if they are still not all there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._readahead_wait_s
        work = 0.0
        looks = 0
        while True:
            began = time.thread_time()
            try:
                return read_cached(self._reader, batches), work + time.thread_time() - began
            except NotCached:
                if looks == 0 and self._readahead_wait_s > 0:
                    read_ahead(self._reader, batches)
            work += time.thread_time() - began
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None, work  # not there (yet): a read thread waits for the disk
            await asyncio.sleep(min(FIRST_LOOK_S * 2**looks, LONGEST_LOOK_S, remaining))
            looks += 1

    def _decide(self, request: QueuedPull, state: DeliveryState) -> Batch | _Linger | None:
        now = self._clock.wall_us()
        for kind, seqs, fields in state.expire(now_us=now, policy=self._policy):
            self._record(_action(kind, now, request, seqs, fields))
        log = self._subjects[request.subject]
        state.skip_below(log.first_seq)
        while True:
            seqs, attempts = state.choose(
                limit=request.max_messages, now_us=now, end_seq=log.end_seq
            )
            if not seqs or min(seqs) >= log.first_seq:
                break
            gone = [seq for seq in seqs if seq < log.first_seq]
            # Retries of messages that retention deleted: dead, saying why, then choose again.
            error = "removed by retention before it was acknowledged"
            self._record(_action(ActionType.DEAD, now, request, gone, {"error": error}))
        if not seqs:
            return None
        lingering = self._clock.now() + TIMER_SLACK_S < request.linger_until
        if len(seqs) < request.min_messages and lingering:
            return LINGER  # chooses nothing yet: waits for a fuller batch
        positions = log.positions(seqs)
        deadline = now + self._policy.ack_timeout_us
        fields = {"consumer": request.consumer, "deadline": deadline, "attempts": attempts}
        self._record(_action(ActionType.LEASE, now, request, seqs, fields), relaxed=True)
        return _batch(request, seqs, attempts, positions, now)

    async def _decide_filtered(
        self, request: QueuedPull, state: DeliveryState, wanted: tuple[str, ...]
    ) -> tuple[Batch | _Linger | _More | None, float]:
        """``_decide`` for a group with a tag filter, and the CPU seconds its scans took.

        Windows of records from the cursor are read until one holds a match or the end of
        the subject is reached, at most ``SCAN_LOOKS`` of them (then ``MORE``: the pull is
        parked and resumed at once, so one group's long run of skipped messages does not
        hold a worker); the decision after each read has no await, and starts over when
        the cursor moved meanwhile (retention, a reset).
        """
        log = self._subjects[request.subject]
        work = 0.0
        for _ in range(SCAN_LOOKS):
            state.skip_below(log.first_seq)
            start = state.cursor
            end = min(log.end_seq, start + SCAN_WINDOW)
            matches: list[int] = []
            unreadable: list[tuple[int, str]] = []
            if start < end:
                matches, unreadable, spent = await self._scan(request, log, start, end, wanted)
                work += spent
                if state.cursor != start:
                    continue
            decided = self._decide_matches(request, state, log, start, end, matches, unreadable)
            if decided is not None or end >= log.end_seq:
                return decided, work
            await asyncio.sleep(0)  # a long run of skipped messages: let the loop breathe
        return MORE, work

    async def _scan(
        self,
        request: QueuedPull,
        log: SubjectLog,
        start: int,
        end: int,
        wanted: tuple[str, ...],
    ) -> tuple[list[int], list[tuple[int, str]], float]:
        """The seqs in ``[start, end)`` whose tags match, the unreadable ones, and the CPU
        seconds the read took."""
        seqs = list(range(start, end))
        positions = log.positions(seqs)
        batch = Batch(
            subject=request.subject,
            seqs=seqs,
            attempts=[1] * len(seqs),
            positions=positions,
            now_us=self._clock.wall_us(),
        )
        delay = self._read_delays.get((request.subject, request.group), 0.0)
        [(messages, unreadable)], work = await self._read([(batch, delay)])
        shown = cast("list[PulledMessageJson]", messages)  # the scan's batch is JSON
        matches = [m["seq"] for m in shown if tags_match(m.get("tags", ()), wanted)]
        return matches, unreadable, work

    def _decide_matches(
        self,
        request: QueuedPull,
        state: DeliveryState,
        log: SubjectLog,
        start: int,
        end: int,
        matches: list[int],
        unreadable: list[tuple[int, str]],
    ) -> Batch | _Linger | None:
        """Lease due retries, then the matches of ``[start, end)``; None when there is
        nothing to serve (the cursor still moves past what the window skipped)."""
        now = self._clock.wall_us()
        for kind, expired, outcome in state.expire(now_us=now, policy=self._policy):
            self._record(_action(kind, now, request, expired, outcome))
        seqs, attempts = state.choose(limit=request.max_messages, now_us=now, end_seq=start)
        gone = [seq for seq in seqs if seq < log.first_seq]
        if gone:  # retries of messages retention deleted (see ``_decide``)
            error = "removed by retention before it was acknowledged"
            self._record(_action(ActionType.DEAD, now, request, gone, {"error": error}))
            seqs, attempts = state.choose(limit=request.max_messages, now_us=now, end_seq=start)
        lingering = self._clock.now() + TIMER_SLACK_S < request.linger_until
        if len(seqs) + len(matches) < request.min_messages and lingering and seqs + matches:
            # not enough for its min yet: skip only what lies before the first match
            self._skip(request, start, matches[0] if matches else end, matches, unreadable, now)
            return LINGER
        taken = matches[: max(request.max_messages - len(seqs), 0)]
        # past what was looked at, or up to the first match left for the next pull
        skip_to = matches[len(taken)] if len(taken) < len(matches) else end
        if not seqs and not taken:
            self._skip(request, start, skip_to, taken, unreadable, now)
            return None
        self._bury_unread(request, unreadable, skip_to, now)
        filtered = _filtered(start, skip_to, taken, unreadable)
        seqs += taken
        attempts += [1] * len(taken)
        positions = log.positions(seqs)
        deadline = now + self._policy.ack_timeout_us
        fields: dict[str, Any] = {
            "consumer": request.consumer,
            "deadline": deadline,
            "attempts": attempts,
        }
        if skip_to > (taken[-1] + 1 if taken else start):  # past skipped or unreadable seqs
            fields["skip_to"] = skip_to
        if filtered:
            fields["filtered"] = filtered
        self._record(_action(ActionType.LEASE, now, request, seqs, fields), relaxed=True)
        self._metrics.filtered.inc(filtered)
        return _batch(request, seqs, attempts, positions, now)

    def _skip(
        self,
        request: QueuedPull,
        start: int,
        skip_to: int,
        matches: list[int],
        unreadable: list[tuple[int, str]],
        now: int,
    ) -> None:
        """Move the cursor to ``skip_to`` past messages the filter skipped: a LEASE record
        of no seqs (the unreadable ones among them go dead)."""
        if skip_to <= start:
            return
        self._bury_unread(request, unreadable, skip_to, now)
        filtered = _filtered(start, skip_to, matches, unreadable)
        fields = {
            "consumer": request.consumer,
            "deadline": now,
            "attempts": [],
            "skip_to": skip_to,
            "filtered": filtered,
        }
        self._record(_action(ActionType.LEASE, now, request, [], fields), relaxed=True)
        self._metrics.filtered.inc(filtered)

    def _bury_unread(
        self, request: QueuedPull, unreadable: list[tuple[int, str]], below: int, now: int
    ) -> None:
        """Records a filtered group's scan could not read, below ``below``: dead letters."""
        lost = [(seq, error) for seq, error in unreadable if seq < below]
        if lost:
            batch = Batch(subject=request.subject, seqs=[], attempts=[], positions=[], now_us=now)
            self._bury(request, batch, lost)

    def _bury(self, request: QueuedPull, batch: Batch, unreadable: list[tuple[int, str]]) -> None:
        for seq, error in unreadable:
            logger.error(
                "unreadable message not served",
                extra={
                    "action": "broker.unreadable",
                    "subject": batch.subject,
                    "seq": seq,
                    "error": error,
                },
            )
        self._metrics.unreadable.inc(len(unreadable))
        seqs = [seq for seq, _ in unreadable]
        fields = {"error": "unreadable record"}
        dead = action(
            ActionType.DEAD,
            at_us=batch.now_us,
            subject=batch.subject,
            group=request.group,
            # an ordered partition's state is the group's (its pulls are keyed by consumer)
            state=request.key if batch.shown_as is None else "",
            seqs=seqs,
            fields=fields,
        )
        self._record(dead)

    def _wake_at(self, state: DeliveryState) -> float | None:
        """The scheduler-clock time of the group's next retry or lease expiry, if any."""
        wakeup = state.next_wakeup_us()
        if wakeup is None:
            return None
        delay = max((wakeup - self._clock.wall_us()) / 1_000_000, 0.001)
        return self._clock.now() + delay


def _batch(
    request: QueuedPull,
    seqs: list[int],
    attempts: list[int],
    positions: list[tuple[int, int, int]],
    now_us: int,
) -> Batch:
    """What ``request`` leased, to read and serve in the form it asked for."""
    return Batch(
        subject=request.subject,
        seqs=seqs,
        attempts=attempts,
        positions=positions,
        now_us=now_us,
        records=request.records,
    )


def _filtered(start: int, end: int, matches: list[int], unreadable: list[tuple[int, str]]) -> int:
    """How many seqs of ``[start, end)`` the filter skipped: neither matched nor unreadable."""
    other = set(matches) | {seq for seq, _ in unreadable}
    return end - start - sum(1 for seq in other if start <= seq < end)


def _action(
    kind: ActionType, now: int, request: QueuedPull, seqs: list[int], fields: dict[str, Any]
) -> ActionRecord:
    return action(
        kind,
        at_us=now,
        subject=request.subject,
        group=request.group,
        state=request.key,
        seqs=seqs,
        fields=fields,
    )
