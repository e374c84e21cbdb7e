"""Produce: store validated messages, dedup by id, answer once they are durable.

Runs on the event loop. A batch is placed in the journal and allocated its seqs with no
await in between; new seqs become visible to pulls only when the batch is durable, so a
pull never serves a message the broker could still lose.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qmq_broker.clock import Clock
from qmq_broker.errors import Conflict, CorruptRecord, StorageError
from qmq_broker.format.ids import id_hash
from qmq_broker.format.messages import Framable, MessageRecord, message_frames
from qmq_broker.lifecycle import Lifecycle, durable
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.pulls.reads import read_message
from qmq_broker.routebook import RouteBook, Target
from qmq_broker.storage.journal import Journal
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectLog, SubjectTable
from qmq_wire import ProduceResultJson, ProduceStatus
from qmq_wire.ordered import split_partition_log

if TYPE_CHECKING:
    from qmq_broker.delayed.service import DelayedMessages


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class ProduceService:
    """``produce`` for producers, ``store_due`` for delayed messages coming due."""

    lifecycle: Lifecycle
    journal: Journal
    subjects: SubjectTable
    reader: SegmentReader
    clock: Clock
    metrics: BrokerMetrics
    wake: Callable[[str], None]
    book: RouteBook = dataclasses.field(default_factory=RouteBook)
    _delayed: DelayedMessages | None = dataclasses.field(init=False, default=None)

    def attach(self, delayed: DelayedMessages) -> None:
        """The delayed-message service (built after this one: it stores through us)."""
        self._delayed = delayed

    async def produce(self, messages: list[IncomingMessage]) -> list[ProduceResultJson]:
        """Store a validated batch; answers once it is durable under the fsync policy.

        A message due later (``deliver_at_us`` after now) goes to the schedule log and is
        answered ``scheduled`` with seq null; it is stored through ``store_due`` when due.
        """
        self.lifecycle.require()
        delayed = self._delayed
        assert delayed is not None, "attach() the delayed-message service first"
        now = self.clock.wall_us()
        hashes = [id_hash(message.id) for message in messages]
        targets = self._targets(messages, now)
        logs = [message.subject for message in messages] if targets is None else targets[0]
        known = self._known(logs, hashes)
        if targets is not None:
            self._known_before(targets[1], hashes, messages, known, logs)
        # the message this request stores under a (log, id hash), kept only when an id
        # hash comes twice in it; a later one is its duplicate
        stored_at: dict[tuple[str, int], int] | None = (
            {} if len(set(hashes)) < len(hashes) else None
        )
        if (
            targets is None
            and stored_at is None
            and messages
            and known.count(None) == len(known)
            and logs.count(logs[0]) == len(logs)
            and not delayed.holds_any()
            and max(message.deliver_at_us for message in messages) <= now
        ):
            return await self._store_all(messages, hashes, now)
        repeats: list[tuple[int, int]] = []  # (message, the earlier one it repeats)
        to_store: dict[str, list[int]] = {}  # per log, the messages it stores, in order
        statuses: list[ProduceStatus] = []
        seqs: list[int | None] = []
        name: str | None = None
        log: SubjectLog | None = None
        for at, (message, target, hashed, seq) in enumerate(
            zip(messages, logs, hashes, known, strict=True)
        ):
            if target != name:  # a batch mostly names one subject: look it up once per run
                name, log = target, self.subjects.find(target)
            if seq is not None and log is not None:
                seq = self._confirmed(log, seq, message.id)
            status: ProduceStatus
            earlier = None if stored_at is None else stored_at.get((target, hashed))
            if earlier is not None:
                repeats.append((at, earlier))
                status = "duplicate"
            elif seq is not None or delayed.is_scheduled(message.subject, message.id):
                status = "duplicate"
            elif message.deliver_at_us > now:
                delayed.accept(message, now_us=now)
                status = "scheduled"
            else:
                run = to_store.get(target)
                if run is None:
                    run = to_store[target] = []
                run.append(at)
                if stored_at is not None:
                    stored_at[target, hashed] = at
                status = "stored"
            statuses.append(status)
            seqs.append(seq)
        visible: dict[str, int] = {}
        for target, run in to_store.items():
            stored = [messages[at] for at in run]
            first = self._store(target, stored, [hashes[at] for at in run], now)
            for offset, at in enumerate(run):
                seqs[at] = first + offset
            visible[target] = first + len(run)
        for at, earlier in repeats:
            seqs[at] = seqs[earlier]
        await self._settle(visible)
        self.metrics.produced.inc(sum(map(len, to_store.values())))
        results: list[ProduceResultJson] = [
            {"id": message.id, "subject": message.subject, "status": status, "seq": seq}
            for message, status, seq in zip(messages, statuses, seqs, strict=True)
        ]
        if targets is not None:
            for result, target in zip(results, logs, strict=True):
                partition = split_partition_log(target)[1]
                if partition is not None:
                    result["partition"] = partition
        return results

    async def _store_all(
        self, messages: list[IncomingMessage], hashes: list[int], now: int
    ) -> list[ProduceResultJson]:
        """``produce`` of the usual batch: every message new, due now, for one subject,
        and nothing scheduled that could hold one of its ids."""
        subject = messages[0].subject
        first = self._store(subject, messages, hashes, now)
        await self._settle({subject: first + len(messages)})
        self.metrics.produced.inc(len(messages))
        return [
            {"id": message.id, "subject": subject, "status": "stored", "seq": seq}
            for seq, message in enumerate(messages, first)
        ]

    def _targets(
        self, messages: list[IncomingMessage], now: int
    ) -> tuple[list[str], list[Target | None]] | None:
        """The log each message goes to, when the batch names an ordered subject (None
        when it does not: every message goes to its subject's own log)."""
        book = self.book
        if not book or not any(book.is_ordered(message.subject) for message in messages):
            return None  # the usual produce: no lookup per message
        logs: list[str] = []
        targets: list[Target | None] = []
        for index, message in enumerate(messages):
            if not book.is_ordered(message.subject):
                logs.append(message.subject)
                targets.append(None)
                continue
            if message.deliver_at_us > now:
                raise Conflict(
                    code="delay_not_ordered",
                    message=f"{message.subject!r} is ordered: its messages cannot be delayed",
                    field=f"messages[{index}].deliver_at",
                )
            target = book.target(message.subject, message.key, index=index)
            logs.append(target.log)
            targets.append(target)
        return logs, targets

    def _known_before(
        self,
        targets: list[Target | None],
        hashes: list[int],
        messages: list[IncomingMessage],
        known: list[int | None],
        logs: list[str],
    ) -> None:
        """Ids of an ordered subject that a partition holding their logic partition before
        a route change already stored: ``duplicate`` there (``known`` and ``logs`` point
        at the earlier partition)."""
        for at, target in enumerate(targets):
            if target is None or known[at] is not None:
                continue
            for earlier in target.earlier:
                log = self.subjects.find(earlier)
                seq = None if log is None else log.seq_of(hashes[at])
                if (
                    log is not None
                    and seq is not None
                    and self._confirmed(log, seq, messages[at].id) is not None
                ):
                    known[at] = seq
                    logs[at] = earlier
                    break

    async def store_commands(
        self,
        commands: list[tuple[str, IncomingMessage]],
        placed: Callable[[list[int]], None],
    ) -> None:
        """Append command messages (each to its partition's log, as its last message) and
        answer once they are durable. ``placed`` gets their seqs as soon as they are
        allocated, before they can become visible: a pull must never take a command for a
        message. Broker-internal: no lifecycle check, no dedup."""
        now = self.clock.wall_us()
        seqs = [
            self._store(log, [message], [id_hash(message.id)], now) for log, message in commands
        ]
        placed(seqs)
        await self._settle({log: seq + 1 for (log, _), seq in zip(commands, seqs, strict=True)})

    async def store_due(self, records: list[MessageRecord]) -> tuple[list[int], int]:
        """Store due delayed messages like produced ones, same ids and dedup; each record
        is framed as it is (a ``Framable`` like an incoming message).

        Returns each one's seq, or -1 when its subject already holds the id (a dispatch
        repeated after a crash), and the stored_at time, once durable.
        """
        self.lifecycle.require()
        now = self.clock.wall_us()
        visible: dict[str, int] = {}
        seqs: list[int] = []
        for record in records:
            hashed = id_hash(record.id)
            log = self.subjects.find(record.subject)
            found = None if log is None else log.seq_of(hashed)
            if (
                log is not None
                and found is not None
                and self._confirmed(log, found, record.id) is not None
            ):
                seqs.append(-1)
                continue
            seq = self._store(record.subject, [record], [hashed], now)
            visible[record.subject] = seq + 1
            seqs.append(seq)
        await self._settle(visible)
        self.metrics.produced.inc(sum(1 for seq in seqs if seq >= 0))
        return seqs, now

    def _known(self, logs: list[str], hashes: list[int]) -> list[int | None]:
        """The seq each message's id hash is stored under in its log's dedup window
        (asked a log at a time, so the dedup filter sees whole batches)."""
        first = logs[0] if logs else ""
        if all(log == first for log in logs):  # the usual request
            found_log = self.subjects.find(first)
            return [None] * len(logs) if found_log is None else found_log.seqs_of(hashes)
        found: list[int | None] = [None] * len(logs)
        positions: dict[str, list[int]] = {}
        for at, name in enumerate(logs):
            at_log = positions.get(name)
            if at_log is None:
                at_log = positions[name] = []
            at_log.append(at)
        for name, at_log in positions.items():
            log = self.subjects.find(name)
            if log is not None:
                seqs = log.seqs_of([hashes[at] for at in at_log])
                for at, seq in zip(at_log, seqs, strict=True):
                    found[at] = seq
        return found

    def _confirmed(self, subject: SubjectLog, seq: int, message_id: str) -> int | None:
        """``seq``, found in the dedup table under this id's hash, if it holds this id.

        A record that cannot be read holds nothing (a pull dead-letters it as unreadable): a
        resend of its message is stored anew, which recovers it."""
        if seq >= subject.end_seq or seq < subject.first_seq:
            return seq  # in flight or past retention: the 64-bit hash decides
        try:
            same = read_message(self.reader, subject, seq).id == message_id
        except (StorageError, CorruptRecord):
            same = False
        return seq if same else None

    def _store(
        self, subject: str, messages: Sequence[Framable], hashes: list[int], now: int
    ) -> int:
        """Frame messages of one subject into the journal as its next seqs (visible once
        durable); returns the first seq."""
        first = self.subjects.next_seq(subject)
        frames = message_frames(messages, subject=subject, first_seq=first, stored_at_us=now)
        entries = self.journal.append_messages(
            frames, subject=subject, first_seq=first, stored_at_us=now, hashed_ids=hashes
        )
        allocated = self.subjects.append(
            subject, entries, hashes, framed_bytes=sum(map(len, frames))
        )
        assert allocated == first
        return first

    async def _settle(self, visible: dict[str, int]) -> None:
        """Wait until everything appended so far is durable; then make new seqs visible.

        Always waits, even for a batch of duplicates only: the original may still be in
        flight, and a ``duplicate`` answer must not come before it is durable.
        """
        commit = self.journal.commit_point()
        if visible:
            commit.add_done_callback(lambda f: self._make_visible(f, visible))
        await durable(commit)

    def _make_visible(self, future: asyncio.Future[None], visible: dict[str, int]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        for name, end in visible.items():
            self.subjects.make_visible(name, end)
            self.wake(name)
