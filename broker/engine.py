"""The broker core: produce, pull, ack, nack, dead letters, stats; recovery and upkeep loops.

Runs on one asyncio loop. State changes happen between awaits, so each operation sees and
leaves a consistent state; disk writes go through the journal's group commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from broker.config import BrokerConfig
from broker.errors import BrokerError, CorruptRecord, RequestError, StorageError, Unavailable
from broker.format import (
    ActionRecord,
    ActionType,
    MessageRecord,
    SegmentKind,
    encode_message,
    id_hash,
    list_segments,
    segment_number,
)
from broker.groups import DeliveryState, Group, Policy
from broker.messages import IncomingMessage, rfc3339, to_wire
from broker.metrics import BrokerMetrics
from broker.pull_reads import RunReader
from broker.pulls import PullService
from broker.schedule.metrics import ScheduleMetrics
from broker.schedule.recovery import recover_schedule
from broker.schedule.scheduler import Scheduler
from broker.scheduling import SCHEDULERS, ActorMetrics, LoopClock
from broker.scheduling import Scheduler as PullScheduler
from broker.storage.checkpoint import Checkpoint
from broker.storage.journal import Journal
from broker.storage.recovery import Recovered, apply_action, recover
from broker.subjects import SubjectLog

logger = logging.getLogger(__name__)
Clock = Callable[[], int]


def wall_clock_us() -> int:
    return time.time_ns() // 1000


class Broker:
    """One broker over one data directory."""

    def __init__(
        self, config: BrokerConfig, *, metrics: BrokerMetrics, clock: Clock = wall_clock_us
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._clock = clock
        self.status = "recovering"  # -> "ready" -> "stopping" | "failed"
        self._subjects: dict[str, SubjectLog] = {}
        self._groups: dict[tuple[str, str], Group] = {}
        self._pulls: PullScheduler | None = None  # built once recovery has the groups
        self._read_pool: ThreadPoolExecutor | None = None
        self._actor_metrics = ActorMetrics(metrics.registry)
        self._journal: Journal | None = None
        self._reader = RunReader(config.data_dir, SegmentKind.MESSAGES)
        self._tasks: list[asyncio.Task[None]] = []
        self._policy = Policy(
            ack_timeout_us=int(config.ack_timeout_s * 1_000_000),
            max_attempts=config.max_attempts,
            backoff_s=config.backoff_s,
        )
        self.recovered: Recovered | None = None
        self._schedule: Scheduler | None = None
        self._schedule_metrics = ScheduleMetrics(metrics.registry)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover on a worker thread (``/healthz`` answers 503 meanwhile), then serve."""
        try:
            recovered = await asyncio.to_thread(
                recover, self.config.data_dir, dedup_window_s=self.config.dedup_window_s
            )
        except BrokerError:
            self.status = "failed"
            logger.critical(
                "recovery failed", extra={"action": "broker.recovery_failed"}, exc_info=True
            )
            raise
        try:
            scheduled = await asyncio.to_thread(recover_schedule, self.config.data_dir)
        except BrokerError:
            self.status = "failed"
            logger.critical(
                "schedule recovery failed",
                extra={"action": "broker.recovery_failed"},
                exc_info=True,
            )
            raise
        self.recovered = recovered
        self._subjects = recovered.subjects
        self._groups = recovered.groups
        self._journal = Journal(
            data_dir=self.config.data_dir,
            fsync=self.config.fsync,
            segment_bytes=self.config.segment_bytes,
            messages_at=recovered.messages_at,
            actions_at=recovered.actions_at,
            buckets_at=scheduled.ends,
            on_fsync=self.metrics.fsync_seconds.observe,
        )
        self._journal.start()
        self._schedule = Scheduler(
            data_dir=self.config.data_dir,
            journal=self._journal,
            recovered=scheduled,
            store_due=self._store_due,
            metrics=self._schedule_metrics,
            clock=self._clock,
            tick_us=int(self.config.schedule_tick_s * 1_000_000),
            load_ahead_us=int(self.config.schedule_load_ahead_s * 1_000_000),
        )
        self._schedule_metrics.watch(self._schedule.snapshot)
        self._spawn(self._schedule.run, "qmq-schedule-wheel")
        self._start_pulls()
        self._spawn(self._checkpoint_loop, "qmq-checkpointer")
        self._spawn(self._retention_loop, "qmq-retention")
        self.status = "ready"
        logger.info(
            "broker recovered",
            extra={
                "action": "broker.recovered",
                "seconds": round(recovered.seconds, 3),
                "subjects": len(self._subjects),
                "messages": sum(s.next_seq - s.first_seq for s in self._subjects.values()),
                "groups": len(self._groups),
                "scheduled": len(scheduled.ids),
                "problems": recovered.problems + scheduled.problems,
            },
        )

    def _spawn(self, loop: Callable[[], Awaitable[None]], name: str) -> None:
        async def supervised() -> None:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.critical(f"{name} died", extra={"action": "broker.loop_died"}, exc_info=True)
                self.status = "failed"
                raise

        self._tasks.append(asyncio.create_task(supervised(), name=name))

    def _start_pulls(self) -> None:
        """Pull actors, their scheduler and its workers (needs the recovered groups)."""
        config = self.config
        self._read_pool = ThreadPoolExecutor(config.workers, thread_name_prefix="qmq-pull-read")
        clock = LoopClock()
        service = PullService(
            groups=self._groups,
            subjects=self._subjects,
            record=self._record,
            reader=self._reader,
            policy=self._policy,
            now_us=self.now_us,
            clock=clock,
            executor=self._read_pool,
            metrics=self.metrics,
            read_delays={(s, g): d for s, g, d in config.debug_read_delay_s},
        )
        self._pulls = SCHEDULERS[config.scheduler](
            processor=service,
            clock=clock,
            workers=config.workers,
            time_slice_s=config.time_slice_s,
            mailbox_size=config.mailbox_size,
            deadline_grace_s=config.pull_grace_s,
            metrics=self._actor_metrics,
        )
        for index in range(config.workers):
            self._spawn(self._pulls.run_worker, f"qmq-pull-worker-{index}")

    def begin_shutdown(self) -> None:
        """Stop taking requests and wake every long poll so it answers now."""
        if self.status == "ready":
            self.status = "stopping"
        if self._pulls is not None:
            self._pulls.drain()

    async def close(self) -> None:
        """Checkpoint and close the journal (after in-flight requests finished)."""
        self.begin_shutdown()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._pulls is not None:
            self._pulls.close()
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=False, cancel_futures=True)
        if self._journal is not None:
            if self._journal.failed is None:
                await self.checkpoint()
            await self._journal.close()
        if self._schedule is not None:
            self._schedule.close()
        self._reader.close()
        logger.info("broker stopped", extra={"action": "broker.stopped"})

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise Unavailable(code="recovering", message="the broker is still recovering")
        return self._journal

    def _require(self, *, write: bool = True) -> Journal:
        if self.status == "recovering":
            raise Unavailable(code="recovering", message="the broker is still recovering")
        if self.status == "stopping":
            raise Unavailable(code="shutting_down", message="the broker is shutting down")
        journal = self.journal
        if write and (self.status == "failed" or journal.failed is not None):
            raise Unavailable(code="read_only", message="storage failed; the broker is read-only")
        return journal

    def now_us(self) -> int:
        return self._clock()

    @property
    def schedule(self) -> Scheduler:
        if self._schedule is None:
            raise Unavailable(code="recovering", message="the broker is still recovering")
        return self._schedule

    # --- produce ----------------------------------------------------------------------------

    async def produce(self, messages: list[IncomingMessage]) -> list[dict[str, Any]]:
        """Store a validated batch; answers once it is durable under the fsync policy.

        A message due later (``deliver_at_us`` after now) goes to the schedule log and is
        answered ``scheduled`` with seq null; the scheduler stores it here when it is due.
        """
        journal = self._require()
        schedule = self.schedule
        now = self.now_us()
        results: list[dict[str, Any]] = []
        visible: dict[str, int] = {}
        for message in messages:
            subject = self._subjects.get(message.subject)
            hashed = id_hash(message.id)
            seq = subject.dedup.get(hashed) if subject is not None else None
            if subject is not None and seq is not None and self._same_id(subject, seq, message.id):
                results.append(_result(message, "duplicate", seq))
            elif schedule.is_scheduled(message.subject, message.id):
                results.append(_result(message, "duplicate", None))
            elif message.deliver_at_us > now:
                schedule.accept(message, now_us=now)
                results.append(_result(message, "scheduled", None))
            else:
                seq = self._append(journal, message, hashed, now, visible)
                results.append(_result(message, "stored", seq))
        await self._settle(journal, visible)
        self.metrics.produced.inc(sum(1 for r in results if r["status"] == "stored"))
        return results

    async def _store_due(self, records: list[MessageRecord]) -> tuple[list[int], int]:
        """The scheduler's way in: store due messages like produced ones, same ids and dedup.

        Returns each one's seq, or -1 when its subject already holds the id (a dispatch
        repeated after a crash), and the stored_at time, once durable.
        """
        journal = self._require()
        now = self.now_us()
        visible: dict[str, int] = {}
        seqs: list[int] = []
        for record in records:
            hashed = id_hash(record.id)
            subject = self._subjects.get(record.subject)
            seq = subject.dedup.get(hashed) if subject is not None else None
            if subject is not None and seq is not None and self._same_id(subject, seq, record.id):
                seqs.append(-1)
                continue
            message = IncomingMessage(
                id=record.id,
                subject=record.subject,
                key=record.key,
                headers=record.headers,
                body=record.body,
                body_base64=record.body_base64,
                producer=record.producer,
                created_at_us=record.created_at_us,
                deliver_at_us=record.deliver_at_us,
            )
            seqs.append(self._append(journal, message, hashed, now, visible))
        await self._settle(journal, visible)
        self.metrics.produced.inc(sum(1 for seq in seqs if seq >= 0))
        return seqs, now

    def _append(
        self,
        journal: Journal,
        message: IncomingMessage,
        hashed: int,
        now: int,
        visible: dict[str, int],
    ) -> int:
        subject = self._subject(message.subject)
        seq = subject.next_seq
        payload = encode_message(
            seq=seq,
            message_id=message.id,
            subject=message.subject,
            key=message.key,
            headers=message.headers,
            body=message.body,
            body_base64=message.body_base64,
            producer=message.producer,
            created_at_us=message.created_at_us if message.created_at_us is not None else now,
            stored_at_us=now,
            deliver_at_us=message.deliver_at_us,
        )
        entry = journal.append_message(
            payload, subject=subject.name, stored_at_us=now, hashed_id=hashed
        )
        subject.allocate(entry)
        subject.bytes_total += subject.raw(seq)[1]
        subject.dedup[hashed] = seq
        visible[subject.name] = seq + 1
        return seq

    async def _settle(self, journal: Journal, visible: dict[str, int]) -> None:
        """Wait until everything appended so far is durable; then make new seqs visible.

        Always waits, even for a batch of duplicates only: the original may still be in
        flight, and a ``duplicate`` answer must not come before it is durable.
        """
        durable = journal.commit_point()
        if visible:
            durable.add_done_callback(lambda f: self._make_visible(f, visible))
        try:
            await asyncio.shield(durable)
        except StorageError as exc:
            raise Unavailable(code="storage_failed", message=str(exc)) from exc

    def _same_id(self, subject: SubjectLog, seq: int, message_id: str) -> bool:
        if seq >= subject.end_seq or seq < subject.first_seq:
            return True  # in flight or past retention: the 64-bit hash decides
        try:
            return self._read(subject, seq).id == message_id
        except (StorageError, CorruptRecord):
            return True

    def _make_visible(self, future: asyncio.Future[None], visible: dict[str, int]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        for name, end in visible.items():
            subject = self._subjects[name]
            if end > subject.end_seq:
                subject.end_seq = end
            self._signal(name).fire()

    def _subject(self, name: str) -> SubjectLog:
        subject = self._subjects.get(name)
        if subject is None:
            subject = self._subjects[name] = SubjectLog(name)
        return subject

    def _signal(self, name: str) -> _SubjectWake:
        """``.fire()`` resumes the long polls parked on a subject (new data, nack, redrive)."""
        return _SubjectWake(self._pulls, name)

    def _read(self, subject: SubjectLog, seq: int) -> MessageRecord:
        segment, length, offset, _, _ = subject.raw(seq)
        payload = self._reader.read(segment, offset, length)
        path = f"messages/{segment}"
        return MessageRecord.decode(payload, path=path, offset=offset)

    # --- pull -------------------------------------------------------------------------------

    async def pull(
        self,
        *,
        subject: str,
        group: str,
        consumer: str,
        max_messages: int,
        wait_ms: int,
        mode: str,
        start: str,
    ) -> list[dict[str, Any]]:
        """Queue a pull in its group's actor (``broker.scheduling``) and wait for the answer.

        Messages as soon as there are some; an empty list when ``wait_ms`` ran out; 429
        ``mailbox_full`` or 503 ``deadline_exceeded`` when the group is overloaded.
        """
        self._require()
        pulls = self._pulls
        if pulls is None:
            raise Unavailable(code="recovering", message="the broker is still recovering")
        self._state_for_pull(subject, group, consumer, mode, start)
        future = pulls.submit(
            subject=subject,
            group=group,
            key=self._groups[(subject, group)].state_key(consumer),
            consumer=consumer,
            max_messages=max_messages,
            wait_s=wait_ms / 1000,
        )
        return await future

    def _state_for_pull(
        self, subject: str, group: str, consumer: str, mode: str, start: str
    ) -> DeliveryState:
        found = self._groups.get((subject, group))
        if found is not None and found.mode != mode:
            raise RequestError(
                status=409,
                code="mode_conflict",
                message=f"group {group!r} on {subject!r} is in {found.mode} mode",
                field="mode",
            )
        key = consumer if mode == "broadcast" else ""
        if found is None or key not in found.states:
            log = self._subject(subject)
            cursor = log.end_seq if start == "latest" else log.first_seq
            self._record(
                ActionRecord(
                    type=ActionType.GROUP,
                    at_us=self.now_us(),
                    subject=subject,
                    group=group,
                    state=key,
                    fields={"mode": mode, "cursor": cursor},
                )
            )
        return self._groups[(subject, group)].states[key]

    def _record(self, record: ActionRecord) -> None:
        self.journal.append_action(record.encode())
        apply_action(self._groups, record)

    # --- ack / nack -------------------------------------------------------------------------

    def _existing_state(
        self, subject: str, group: str, consumer: str
    ) -> tuple[Group, DeliveryState, str]:
        found = self._groups.get((subject, group))
        if found is None:
            raise RequestError(
                status=404,
                code="group_not_found",
                message=f"no group {group!r} on {subject!r}",
                field="group",
            )
        key = found.state_key(consumer)
        state = found.states.get(key)
        if state is None:
            raise RequestError(
                status=404,
                code="consumer_not_found",
                message=f"consumer {consumer!r} has not pulled from broadcast group {group!r}",
                field="consumer",
            )
        return found, state, key

    async def ack(
        self, *, subject: str, group: str, consumer: str, seqs: list[int]
    ) -> dict[str, Any]:
        journal = self._require()
        _, state, key = self._existing_state(subject, group, consumer)
        unique = list(dict.fromkeys(seqs))
        known = [s for s in unique if state.known(s)]
        unknown = [s for s in unique if not state.known(s)]
        if known:
            self._record(_action(ActionType.ACK, self.now_us(), subject, group, key, known, {}))
            await self._durable(journal)
        self.metrics.acked.inc(len(known))
        return {"acked": len(known), "unknown": unknown}

    async def nack(
        self,
        *,
        subject: str,
        group: str,
        consumer: str,
        seqs: list[int],
        delay_ms: int | None,
        error: str | None,
    ) -> dict[str, Any]:
        journal = self._require()
        _, state, key = self._existing_state(subject, group, consumer)
        now = self.now_us()
        delay_us = delay_ms * 1000 if delay_ms is not None else None
        retry, dead = state.nack_outcomes(
            dict.fromkeys(seqs), now_us=now, delay_us=delay_us, policy=self._policy
        )
        retrying = 0
        for due, batch in sorted(retry.items()):
            self._record(
                _action(
                    ActionType.RETRY, now, subject, group, key, batch, {"due": due, "error": error}
                )
            )
            retrying += len(batch)
        if dead:
            self._record(_action(ActionType.DEAD, now, subject, group, key, dead, {"error": error}))
        if retrying or dead:
            self._signal(subject).fire()
            await self._durable(journal)
        self.metrics.nacked.inc(retrying + len(dead))
        return {"retrying": retrying, "dead": len(dead)}

    async def _durable(self, journal: Journal) -> None:
        try:
            await asyncio.shield(journal.commit_point())
        except StorageError as exc:
            raise Unavailable(code="storage_failed", message=str(exc)) from exc

    # --- dead letters -----------------------------------------------------------------------

    def dead_letters(
        self, *, subject: str, group: str, limit: int, after_seq: int | None
    ) -> dict[str, Any]:
        self._require(write=False)
        found = self._group_or_404(subject, group)
        rows: list[tuple[int, str, Any]] = []
        for key, state in found.states.items():
            rows.extend((seq, key, dead) for seq, dead in state.dead.items())
        rows.sort(key=lambda row: (row[0], row[1]))
        if after_seq is not None:
            rows = [row for row in rows if row[0] > after_seq]
        page = rows[:limit]
        log = self._subjects[subject]
        out = []
        for seq, key, dead in page:
            item: dict[str, Any] = {
                "seq": seq,
                "attempts": dead.attempts,
                "error": dead.error,
                "dead_at": rfc3339(dead.at_us),
                "consumer": key or None,
            }
            try:
                item["message"] = to_wire(self._read(log, seq), attempt=dead.attempts)
            except (StorageError, CorruptRecord):
                item["message"] = None
            out.append(item)
        more = len(rows) > limit
        return {"dead": out, "next_after_seq": page[-1][0] if page and more else None}

    async def redrive(self, *, subject: str, group: str, seqs: list[int] | None) -> int:
        journal = self._require()
        found = self._group_or_404(subject, group)
        now = self.now_us()
        total = 0
        for key, state in found.states.items():
            chosen = (
                list(state.dead)
                if seqs is None
                else [s for s in dict.fromkeys(seqs) if s in state.dead]
            )
            if chosen:
                self._record(
                    _action(ActionType.REDRIVE, now, subject, group, key, sorted(chosen), {})
                )
                total += len(chosen)
        if total:
            self._signal(subject).fire()
            await self._durable(journal)
        return total

    def _group_or_404(self, subject: str, group: str) -> Group:
        if subject not in self._subjects:
            raise RequestError(
                status=404,
                code="subject_not_found",
                message=f"no subject {subject!r}",
                field="subject",
            )
        found = self._groups.get((subject, group))
        if found is None:
            raise RequestError(
                status=404,
                code="group_not_found",
                message=f"no group {group!r} on {subject!r}",
                field="group",
            )
        return found

    # --- stats ------------------------------------------------------------------------------

    def subjects_stats(self) -> list[dict[str, Any]]:
        self._require(write=False)
        return [self._subjects[name].stats() for name in sorted(self._subjects)]

    def subject_stats(self, name: str) -> dict[str, Any]:
        self._require(write=False)
        subject = self._subjects.get(name)
        if subject is None and self.schedule.knows(name):
            subject = SubjectLog(name)  # only delayed messages so far
        if subject is None:
            raise RequestError(
                status=404,
                code="subject_not_found",
                message=f"no subject {name!r}",
                field="subject",
            )
        doc: dict[str, Any] = dict(subject.stats())
        doc["scheduled"] = self.schedule.subject_stats(name)
        doc["groups"] = [
            group.stats(subject.end_seq)
            for (s, _), group in sorted(self._groups.items())
            if s == name
        ]
        return doc

    def schedule_stats(self, *, limit: int) -> dict[str, Any]:
        """``GET /v1/schedule``: pending delayed messages by hour, next due time, lag."""
        self._require(write=False)
        return self.schedule.stats(limit=limit)

    def group_backlogs(self) -> Iterable[tuple[str, str, dict[str, Any]]]:
        for (subject, name), group in self._groups.items():
            log = self._subjects.get(subject)
            if log is not None:
                yield subject, name, group.stats(log.end_seq)

    # --- upkeep -----------------------------------------------------------------------------

    async def checkpoint(self) -> None:
        """Save group state and index positions so recovery replays only what follows."""
        journal = self.journal
        snapshot: dict[str, dict[str, Any]] = {}
        for (subject, name), group in self._groups.items():
            snapshot.setdefault(subject, {})[name] = group.snapshot()
        checkpoint = Checkpoint(
            messages_at=journal.messages.tell(),
            actions_at=journal.actions.tell(),
            groups=snapshot,
            written_at_us=self.now_us(),
        )
        data_dir = self.config.data_dir

        def job() -> None:
            journal.fsync_logs()
            journal.fsync_indexes()
            checkpoint.write(data_dir)

        await journal.run_after_flush(job)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_interval_s)
            began = time.perf_counter()
            await self.checkpoint()
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - began)

    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.retention_check_interval_s)
            await self.apply_retention()

    async def apply_retention(self) -> None:
        """Delete whole segments older than the retention; evict old dedup entries."""
        journal = self.journal
        now = self.now_us()
        horizon_s = now / 1_000_000 - self.config.retention_s
        active = journal.messages.segment
        doomed = [
            path
            for path in list_segments(self.config.data_dir, SegmentKind.MESSAGES)
            if segment_number(path) < active and path.stat().st_mtime < horizon_s
        ]
        checkpointed_actions = Checkpoint.load(self.config.data_dir).actions_at[0]
        doomed_actions = [
            path
            for path in list_segments(self.config.data_dir, SegmentKind.ACTIONS)
            if segment_number(path) < min(checkpointed_actions, journal.actions.segment)
            and path.stat().st_mtime < horizon_s
        ]
        if doomed:
            oldest_left = segment_number(doomed[-1]) + 1
            for subject in self._subjects.values():
                self._advance_first_seq(subject, oldest_left)
            for path in doomed:
                self._reader.forget(segment_number(path))
                path.unlink()
            logger.info(
                "retention removed segments",
                extra={"action": "broker.retention", "segments": [p.name for p in doomed]},
            )
        for path in doomed_actions:
            path.unlink()
        self._evict_dedup(now)

    def _advance_first_seq(self, subject: SubjectLog, oldest_segment: int) -> None:
        seq = subject.first_seq
        while seq < subject.end_seq:
            segment, length, _, _, _ = subject.raw(seq)
            if segment >= oldest_segment:
                break
            subject.bytes_total -= length
            seq += 1
        subject.first_seq = seq

    def _evict_dedup(self, now_us: int) -> None:
        horizon = now_us - int(self.config.dedup_window_s * 1_000_000)
        for subject in self._subjects.values():
            stale = []
            for hashed, seq in subject.dedup.items():
                if subject.raw(seq)[3] >= horizon:
                    break
                stale.append(hashed)
            for hashed in stale:
                del subject.dedup[hashed]


def _result(message: IncomingMessage, status: str, seq: int | None) -> dict[str, Any]:
    return {"id": message.id, "subject": message.subject, "status": status, "seq": seq}


def _action(
    kind: ActionType,
    now: int,
    subject: str,
    group: str,
    key: str,
    seqs: list[int],
    fields: dict[str, Any],
) -> ActionRecord:
    return ActionRecord(
        type=kind,
        at_us=now,
        subject=subject,
        group=group,
        state=key,
        seqs=tuple(seqs),
        fields=fields,
    )


class _SubjectWake:
    """What ``Broker._signal`` hands out: firing it resumes a subject's parked pulls."""

    __slots__ = ("_pulls", "_subject")

    def __init__(self, pulls: PullScheduler | None, subject: str) -> None:
        self._pulls = pulls
        self._subject = subject

    def fire(self) -> None:
        if self._pulls is not None:
            self._pulls.wake_subject(self._subject)
