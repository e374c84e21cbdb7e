"""Delayed messages: accepts them, loads hours into the wheel, dispatches due ones.

Event-loop side, except file reads (worker threads). One supervised loop (``run``, named
``qmq-schedule-wheel`` by the broker) sleeps until the wheel's next due time or one tick,
then ``step``\\ s: move coarse buckets whose time came into finer ones (``tiers``), load
the hours that come within ``load_ahead``, hand due entries to the broker's produce path,
record them in the dispatch log, and delete hours that are done.

Counts are kept per due hour wherever a record lies (an hour, a day or a 32-day bucket),
so stats and the next due time do not depend on the tiering. A move copies records into
finer buckets; the coarse segment is deleted only once every copy is on disk, and a copy
found beside its source after a crash is counted once (``recovery``).

Exactly-once across restarts: a dispatch is recorded only after the dispatched messages
are durable, so the dispatch log never lists a message that is not stored. A crash
between the two makes the restarted broker dispatch the message again; the produce path
finds its id in the subject's dedup table, stores nothing, and the dispatch is recorded
then (seq -1). The dedup window must therefore exceed the downtime, which its 7-day
default does by far.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import heapq
import logging
import time
from array import array
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from qmq_broker.clock import Clock
from qmq_broker.delayed.metrics import ScheduleMetrics
from qmq_broker.delayed.recovery import BucketCounts, ScheduleRecovered
from qmq_broker.delayed.scan import dispatched_offsets, pending_entries, read_payloads
from qmq_broker.delayed.tiers import Tiers
from qmq_broker.delayed.wheel import DEFAULT_TICK_US, TimingWheel, WheelEntry
from qmq_broker.errors import CorruptRecord, StorageError, Unavailable
from qmq_broker.format.files import HEADER_SIZE, SegmentKind
from qmq_broker.format.messages import MessageRecord
from qmq_broker.format.schedule import (
    HOUR_US,
    DispatchRecord,
    ScheduleRecord,
    bucket_start_us,
    hour_bucket,
    schedule_key,
)
from qmq_broker.messages import IncomingMessage, rfc3339
from qmq_broker.storage.buckets import BucketKey
from qmq_broker.storage.journal import Journal
from qmq_broker.storage.segments import Position, SegmentReader, segment_path

logger = logging.getLogger(__name__)

# Stores due messages through the broker's produce path; returns each one's seq (-1: the
# subject already held that id) and the stored_at time, once they are durable.
StoreDue = Callable[[list[MessageRecord]], Awaitable[tuple[list[int], int]]]

UNREADABLE = -2  # seq recorded for a schedule record that could not be read back
DEFAULT_CHUNK = 1000
DEFAULT_WHEEL_CAP = 200_000
MAX_INFLIGHT = 4  # dispatch chunks waiting for their group commit at once
MOVE_CHUNK_BYTES = 4 * 1024 * 1024  # records of a coarse bucket moved per step


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledCount:
    messages: int
    bytes: int
    unreadable: int  # lost to damaged schedule files (those whose record still names it)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledHour:
    hour: str
    messages: int
    bytes: int
    loaded: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LastDispatch:
    at: str
    lateness_ms: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleStats:
    """``GET /v1/schedule``: what waits, by hour, and how the dispatch keeps up."""

    messages: int
    bytes: int
    next_due_at: str | None
    dispatch_lag_ms: float
    wheel_messages: int
    dispatched: int
    unreadable: int  # delayed messages lost to damaged schedule files since start
    last_dispatch: LastDispatch | None
    hours: list[ScheduledHour]
    more_hours: bool


@dataclasses.dataclass(slots=True)
class _Coarse:
    """A coarse bucket on disk, and how far its move has got."""

    skip: set[int]  # offsets of records already moved (by a move a crash cut short)
    cursor: int = HEADER_SIZE
    end: int | None = None  # where its records end; set when its move begins


@dataclasses.dataclass(slots=True)
class _Hour:
    counts: BucketCounts
    live_from: int | None = None  # records at or past this offset go straight to the wheel
    loaded: bool = False


@dataclasses.dataclass(kw_only=True, eq=False)
class DelayedMessages:
    """Delayed messages of one broker."""

    data_dir: Path
    journal: Journal
    recovered: dataclasses.InitVar[ScheduleRecovered]
    store_due: StoreDue
    metrics: ScheduleMetrics
    clock: Clock
    tick_us: int = DEFAULT_TICK_US
    load_ahead_us: int = 300_000_000
    chunk: int = DEFAULT_CHUNK
    wheel_cap: int = DEFAULT_WHEEL_CAP

    def __post_init__(self, recovered: ScheduleRecovered) -> None:
        self._wheel = TimingWheel(tick_us=self.tick_us)
        self._ids = recovered.ids
        self._subjects = recovered.subjects
        self._hours = {b: _Hour(counts) for b, counts in recovered.buckets.items()}
        self._unloaded = sorted(self._hours)  # a heap (sorted lists are heaps)
        self._loaded: set[int] = set()
        self._pending = sum(c.pending for c in recovered.buckets.values())
        self._bytes = sum(c.bytes for c in recovered.buckets.values())
        self._reader = SegmentReader(self.data_dir, SegmentKind.SCHEDULE)
        self._tiers = Tiers(load_ahead_us=self.load_ahead_us)
        self._coarse = {key: _Coarse(skip) for key, skip in recovered.coarse.items()}
        self._to_move = [(self._tiers.move_at_us(*key), *key) for key in self._coarse]
        heapq.heapify(self._to_move)
        self._moving_through: dict[SegmentKind, int] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.dispatched = 0
        self.unreadable = 0
        self._unreadable_of: collections.Counter[str] = collections.Counter()
        for lost in recovered.unreadable:
            self._count_unreadable(lost.subject, lost=lost.lost, records=lost.records)
        self.last_lateness_us: int | None = None
        self.last_dispatch_us: int | None = None

    # --- produce side ---------------------------------------------------------------------

    def holds_any(self) -> bool:
        """Whether any message waits in the schedule log."""
        return bool(self._ids)

    def is_scheduled(self, subject: str, message_id: str) -> bool:
        """True while a message with this id waits in the schedule log for this subject."""
        if not self._ids:
            return False  # the common case: nothing scheduled, no hash to compute
        return schedule_key(subject, message_id) in self._ids

    def accept(self, message: IncomingMessage, *, now_us: int) -> None:
        """Append a delayed message to its schedule bucket (durable with the batch)."""
        due = message.deliver_at_us
        record = ScheduleRecord(
            message=MessageRecord(
                seq=0,
                id=message.id,
                subject=message.subject,
                key=message.key,
                headers=message.headers,
                body=message.body,
                body_base64=message.body_base64,
                producer=message.producer,
                created_at_us=(
                    message.created_at_us if message.created_at_us is not None else now_us
                ),
                stored_at_us=now_us,
                deliver_at_us=due,
                tags=message.tags,
            ),
            key=schedule_key(message.subject, message.id),
        )
        position = self._append(record.encode(), due, now_us=now_us)
        self._hour(hour_bucket(due)).counts.add(due, position.length)
        self._pending += 1
        self._bytes += position.length
        self._ids.add(record.key)
        per_subject = self._subjects.setdefault(message.subject, [0, 0])
        per_subject[0] += 1
        per_subject[1] += position.length
        self.metrics.scheduled.inc()

    def _append(self, payload: bytes, due: int, *, now_us: int) -> Position:
        """Append a schedule record to the bucket it belongs in now; an hour's record goes
        to the wheel once durable if its hour is loaded."""
        kind, bucket = self._tiers.place(due, now_us=now_us, moving_through=self._moving_through)
        position = self.journal.append_bucket(kind, bucket, payload)
        if kind is not SegmentKind.SCHEDULE:
            if (kind, bucket) not in self._coarse:
                self._coarse[(kind, bucket)] = _Coarse(set())
                heapq.heappush(self._to_move, (self._tiers.move_at_us(kind, bucket), kind, bucket))
            return position
        hour = self._hour(bucket)
        if hour.live_from is not None and position.offset >= hour.live_from:
            entry = WheelEntry(due, position.offset, position.length)
            self.journal.commit_point().add_done_callback(
                lambda future: self._to_wheel(future, entry)
            )
        elif bucket * HOUR_US <= now_us + self.load_ahead_us:
            self._wake.set()  # an hour that should be in the wheel already: load it now
        return position

    def _hour(self, bucket: int) -> _Hour:
        hour = self._hours.get(bucket)
        if hour is None:
            hour = self._hours[bucket] = _Hour(BucketCounts())
            heapq.heappush(self._unloaded, bucket)
        return hour

    def _to_wheel(self, future: asyncio.Future[None], entry: WheelEntry) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        self._wheel.add(*entry)
        self._wake.set()

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Supervised loop: step, then sleep until the next due time (at most one tick)."""
        while True:
            self._wake.clear()
            try:
                await self.step()
            except Unavailable as exc:
                if exc.code == "shutting_down":
                    return
                raise
            delay = self._sleep_seconds(self.clock.wall_us())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    def _sleep_seconds(self, now_us: int) -> float:
        wakeup = self._wheel.next_wakeup_us()
        if wakeup is None or wakeup - now_us >= self.tick_us:
            return self.tick_us / 1_000_000
        return max(wakeup - now_us, 0) / 1_000_000

    async def step(self) -> None:
        """Load what came near, dispatch everything due, delete finished hours."""
        async with self._lock:
            now = self.clock.wall_us()
            await self._move_near(now)
            await self._load_near(now)
            await self._dispatch_due(now)
            await self._clean(self.clock.wall_us())

    async def _dispatch_due(self, now_us: int) -> None:
        """Dispatch everything due, in chunks, a few in flight at once.

        A chunk is read on a worker thread while earlier chunks wait for their group
        commit, so one fsync can cover several chunks. Chunks are appended in due order
        (tasks start in creation order, and each appends before its first await).
        """
        inflight: collections.deque[asyncio.Task[None]] = collections.deque()
        try:
            while due := self._wheel.pop_due(now_us, limit=self.chunk):
                read = await asyncio.to_thread(self._read_records, due)
                inflight.append(asyncio.create_task(self._dispatch(due, read)))
                while inflight and (len(inflight) > MAX_INFLIGHT or inflight[0].done()):
                    await inflight.popleft()
                now_us = self.clock.wall_us()
        finally:
            results = await asyncio.gather(*inflight, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    # --- moving coarse buckets -----------------------------------------------------------

    async def _move_near(self, now_us: int) -> None:
        """Move the coarse buckets whose time came into finer ones, a chunk per step (due
        dispatches are not held up); the loop runs again at once while a move is unfinished."""
        while self._to_move and self._to_move[0][0] <= now_us:
            _, kind, bucket = self._to_move[0]
            if not await self._move_chunk((kind, bucket), now_us):
                self._wake.set()
                return
            heapq.heappop(self._to_move)

    async def _move_chunk(self, key: BucketKey, now_us: int) -> bool:
        """Copy the next chunk of a coarse bucket into finer buckets; True once it is gone."""
        kind, bucket = key
        coarse = self._coarse[key]
        if coarse.end is None:
            self._moving_through[kind] = max(self._moving_through.get(kind, -1), bucket)
            coarse.end = self.journal.buckets.end(kind, bucket)
            await self.journal.commit_point()  # everything before `end` is written
        payloads, coarse.cursor = await asyncio.to_thread(
            read_payloads,
            self.data_dir,
            kind,
            bucket,
            start=coarse.cursor,
            end=coarse.end,
            skip=coarse.skip,
            max_bytes=MOVE_CHUNK_BYTES,
        )
        for payload in payloads:
            due, _ = ScheduleRecord.peek(payload, path=f"{kind.name}/{bucket}")
            self._append(payload, due, now_us=now_us)
        self.metrics.moved.inc(len(payloads))
        if coarse.cursor < coarse.end:
            await self.journal.commit_point()  # one chunk in memory at a time
            return False
        # the copies reach the disk before their source goes
        await self.journal.run_after_flush(self.journal.fsync_logs)
        await self.journal.remove_buckets([key])
        del self._coarse[key]
        logger.info(
            "schedule bucket moved",
            extra={
                "action": "broker.schedule_moved",
                "bucket": kind.name.lower(),
                "start": rfc3339(bucket_start_us(kind, bucket)),
            },
        )
        return True

    # --- loading hours --------------------------------------------------------------------

    async def _load_near(self, now_us: int) -> None:
        # an hour a coarse bucket may still hold records of waits for its move (due order)
        unmoved = min((bucket_start_us(*key) for key in self._coarse), default=None)
        while self._unloaded:
            bucket = self._unloaded[0]
            start = bucket * HOUR_US
            if start > now_us + self.load_ahead_us:
                return
            if unmoved is not None and start >= unmoved:
                return
            if start + HOUR_US <= now_us and len(self._wheel) >= self.wheel_cap:
                return  # a backlog of past hours: load the next once the wheel drained
            heapq.heappop(self._unloaded)
            await self._load(bucket)

    async def _load(self, bucket: int) -> None:
        began = time.perf_counter()
        hour = self._hours[bucket]
        end = self.journal.buckets.end(SegmentKind.SCHEDULE, bucket)
        dispatch_end = self.journal.buckets.end(SegmentKind.DISPATCH, bucket)
        hour.live_from = end  # from here on, new records of this hour go straight to the wheel
        await self.journal.commit_point()  # everything before `end` is written
        entries = await asyncio.to_thread(self._read_hour, bucket, end, dispatch_end)
        for i in range(0, len(entries), 3):
            self._wheel.add(entries[i], entries[i + 1], entries[i + 2])
        hour.loaded = True
        self._loaded.add(bucket)
        seconds = time.perf_counter() - began
        self.metrics.load_seconds.observe(seconds)
        logger.info(
            "schedule hour loaded",
            extra={
                "action": "broker.schedule_loaded",
                "hour": rfc3339(bucket * HOUR_US),
                "messages": len(entries) // 3,
                "seconds": round(seconds, 3),
            },
        )

    def _read_hour(self, bucket: int, end: int, dispatch_end: int) -> array[int]:
        done = dispatched_offsets(self.data_dir, bucket, end=dispatch_end)
        return pending_entries(self.data_dir, bucket, end=end, dispatched=done)

    # --- dispatching ----------------------------------------------------------------------

    async def _dispatch(self, due: list[WheelEntry], read: list[ScheduleRecord | None]) -> None:
        """Store one chunk through the produce path; once durable, record its dispatch."""
        readable = [r.message for r in read if r is not None]
        seqs: list[int] = []
        stored_at = self.clock.wall_us()
        if readable:
            seqs, stored_at = await self.store_due(readable)
        seqs_iter = iter(seqs)
        done: dict[int, tuple[list[int], list[int]]] = {}
        stored = repeated = 0
        for entry, record in zip(due, read, strict=True):
            seq = UNREADABLE if record is None else next(seqs_iter)
            if record is None:
                self._count_unreadable(None)
            bucket = hour_bucket(entry.deliver_at_us)
            offsets, seqs_done = done.setdefault(bucket, ([], []))
            offsets.append(entry.offset)
            seqs_done.append(seq)
            self._forget(bucket, entry, record)
            if seq >= 0:
                stored += 1
                self.metrics.lateness.observe(max(stored_at - entry.deliver_at_us, 0) / 1e6)
            elif seq == -1:
                repeated += 1
        for bucket, (offsets, seqs_done) in done.items():
            payload = DispatchRecord(at_us=stored_at, offsets=tuple(offsets), seqs=tuple(seqs_done))
            self.journal.append_bucket(SegmentKind.DISPATCH, bucket, payload.encode())
        # written now, not with whatever the journal writes next (on an idle broker, the
        # next checkpoint): the fewer dispatches a crash forgets, the fewer go out again
        self.journal.commit_point().add_done_callback(_written)
        self.dispatched += stored
        self.metrics.dispatched.inc(stored)
        self.metrics.redispatched.inc(repeated)
        self.last_dispatch_us = stored_at
        self.last_lateness_us = stored_at - due[-1].deliver_at_us

    def _read_records(self, due: list[WheelEntry]) -> list[ScheduleRecord | None]:
        out: list[ScheduleRecord | None] = []
        for entry in due:
            bucket = hour_bucket(entry.deliver_at_us)
            path = f"schedule/{bucket}"
            try:
                payload = self._reader.read(bucket, entry.offset, entry.length)
                out.append(ScheduleRecord.decode(payload, path=path, offset=entry.offset))
            except (CorruptRecord, StorageError) as exc:
                logger.error(
                    "unreadable scheduled message dropped",
                    extra={
                        "action": "broker.schedule_unreadable",
                        "path": str(segment_path(self.data_dir, SegmentKind.SCHEDULE, bucket)),
                        "start": entry.offset,
                        "end": entry.offset + entry.length,
                        "error": str(exc),
                    },
                )
                out.append(None)
        return out

    def _count_unreadable(
        self, subject: str | None, *, lost: bool = True, records: int = 1
    ) -> None:
        """Delayed messages lost to damage (or, ``lost`` False, a dispatch record)."""
        if not lost:
            self.metrics.unreadable_dispatches.inc()
            return
        self.unreadable += records
        self.metrics.unreadable.inc(records)
        if subject is not None:
            self._unreadable_of[subject] += records

    def _forget(self, bucket: int, entry: WheelEntry, record: ScheduleRecord | None) -> None:
        counts = self._hours[bucket].counts
        counts.pending -= 1
        counts.bytes -= entry.length
        self._pending -= 1
        self._bytes -= entry.length
        if record is None:
            return
        self._ids.discard(record.key)
        per_subject = self._subjects.get(record.message.subject)
        if per_subject is not None:
            per_subject[0] -= 1
            per_subject[1] -= entry.length
            if per_subject[0] <= 0:
                del self._subjects[record.message.subject]

    async def _clean(self, now_us: int) -> None:
        finished = [
            b
            for b in self._loaded
            if self._hours[b].counts.pending <= 0 and (b + 1) * HOUR_US <= now_us
        ]
        if not finished:
            return
        for bucket in finished:
            self._loaded.discard(bucket)
            del self._hours[bucket]
            self._reader.forget(bucket)
        keys = [
            (kind, b) for b in finished for kind in (SegmentKind.SCHEDULE, SegmentKind.DISPATCH)
        ]
        await self.journal.remove_buckets(keys)
        logger.info(
            "schedule hours done",
            extra={
                "action": "broker.schedule_cleaned",
                "hours": [rfc3339(b * HOUR_US) for b in finished],
            },
        )

    def close(self) -> None:
        self._reader.close()

    # --- stats ----------------------------------------------------------------------------

    def next_due_us(self) -> int | None:
        candidates = []
        in_wheel = self._wheel.next_due_us()
        if in_wheel is not None:
            candidates.append(in_wheel)
        if self._unloaded:
            first = self._hours[self._unloaded[0]].counts.min_due_us
            if first is not None:
                candidates.append(first)
        return min(candidates) if candidates else None

    def snapshot(self) -> dict[str, Any]:
        """Totals for metrics: pending messages and bytes, hours, wheel size, next due, lag."""
        next_due = self.next_due_us()
        now = self.clock.wall_us()
        return {
            "messages": self._pending,
            "bytes": self._bytes,
            "hours": sum(1 for h in self._hours.values() if h.counts.pending > 0),
            "wheel": len(self._wheel),
            "id_set_bytes": self._ids.nbytes(),
            "next_due_us": next_due,
            "lag_us": max(now - next_due, 0) if next_due is not None else 0,
        }

    def stats(self, *, limit: int) -> ScheduleStats:
        """Totals, next due time, dispatch lag and the first ``limit`` hours."""
        snap = self.snapshot()
        hours = sorted(b for b, h in self._hours.items() if h.counts.pending > 0)
        listed = [
            ScheduledHour(
                hour=rfc3339(bucket * HOUR_US),
                messages=self._hours[bucket].counts.pending,
                bytes=self._hours[bucket].counts.bytes,
                loaded=self._hours[bucket].loaded,
            )
            for bucket in hours[:limit]
        ]
        last = None
        if self.last_dispatch_us is not None and self.last_lateness_us is not None:
            last = LastDispatch(
                at=rfc3339(self.last_dispatch_us),
                lateness_ms=round(self.last_lateness_us / 1000, 3),
            )
        return ScheduleStats(
            messages=snap["messages"],
            bytes=snap["bytes"],
            next_due_at=rfc3339(snap["next_due_us"]) if snap["next_due_us"] else None,
            dispatch_lag_ms=round(snap["lag_us"] / 1000, 3),
            wheel_messages=snap["wheel"],
            dispatched=self.dispatched,
            unreadable=self.unreadable,
            last_dispatch=last,
            hours=listed,
            more_hours=len(hours) > limit,
        )

    def subject_stats(self, subject: str) -> ScheduledCount:
        messages, size = self._subjects.get(subject, (0, 0))
        unreadable = self._unreadable_of.get(subject, 0)
        return ScheduledCount(messages=messages, bytes=size, unreadable=unreadable)

    def knows(self, subject: str) -> bool:
        return subject in self._subjects or subject in self._unreadable_of


def _written(future: asyncio.Future[None]) -> None:
    """A dispatch record's commit, which nobody awaits: a failed write has already turned
    the journal read-only and been logged; reading the outcome keeps asyncio from reporting
    it again."""
    if not future.cancelled():
        future.exception()
