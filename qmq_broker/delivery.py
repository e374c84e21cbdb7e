"""Delivery to consumer groups: pull, ack, nack, dead letters and redrive.

Every change of group state is an action record, written through ``ActionLog.record`` (which
appends it and applies it to the ``GroupTable``); acks, nacks and redrives are answered
once their records are durable. Pulls are queued in their group's actor
(``qmq_broker.pulls``), which decides and reads them.
"""

from __future__ import annotations

import dataclasses

from qmq_broker.actions import ActionLog, action
from qmq_broker.clock import Clock
from qmq_broker.errors import Conflict, CorruptRecord, NotFound, StorageError
from qmq_broker.format.actions import ActionType
from qmq_broker.groups import DeliveryState, Group, GroupTable
from qmq_broker.lifecycle import Lifecycle, durable
from qmq_broker.messages import pulled, rfc3339
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.pulls.ordered import OrderedPulls
from qmq_broker.pulls.reads import Served, read_message
from qmq_broker.pulls.scheduler import PullScheduler
from qmq_broker.storage.journal import Journal
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectTable
from qmq_wire import DEFAULT_KEYS_IN_FLIGHT, PulledMessageJson
from qmq_wire.delivery import RetryPolicy
from qmq_wire.keyed import first_of_each_key
from qmq_wire.ordered import partition_log
from qmq_wire.rules import Position


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AckResult:
    acked: int
    unknown: list[int]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NackResult:
    retrying: int
    dead: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterView:
    seq: int
    attempts: int
    error: str | None
    dead_at: str
    consumer: str | None  # the broadcast consumer; None in shared mode
    message: PulledMessageJson | None  # None when the record can no longer be read


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterPage:
    dead: list[DeadLetterView]
    next_after_seq: int | None


@dataclasses.dataclass(kw_only=True, eq=False)
class DeliveryService:
    """What consumers do to a group: pull, ack, nack; what operators do: list and redrive."""

    lifecycle: Lifecycle
    journal: Journal
    subjects: SubjectTable
    groups: GroupTable
    actions: ActionLog
    pulls: PullScheduler
    reader: SegmentReader
    policy: RetryPolicy
    clock: Clock
    metrics: BrokerMetrics
    ordered: OrderedPulls

    # --- pull ------------------------------------------------------------------------------

    async def ack_and_pull(
        self,
        *,
        subject: str,
        group: str,
        consumer: str,
        max_messages: int,
        wait_ms: int,
        mode: str,
        start: Position | str,
        ack: list[int] | None,
        min_messages: int = 1,
        linger_ms: int = 0,
        max_keys: int = DEFAULT_KEYS_IN_FLIGHT,
        tags: list[str] | None = None,
        records: bool = False,
    ) -> tuple[list[Served], AckResult | None]:
        """Queue a pull in its group's actor and wait for the answer, acking ``ack`` (the
        consumer's previous batch, or None) in the same request.

        Messages as soon as there are some (at least ``min_messages`` of them during the
        first ``linger_ms``); ``max_keys``: an ordered partition's keys in flight at once;
        an empty list when ``wait_ms`` ran out; ``mailbox_full`` or
        ``deadline_exceeded`` when the group is overloaded.

        ``start`` places a group (a broadcast consumer) its first pull makes: a checked
        position, or ``"earliest"`` / ``"latest"``.

        The acks are applied once the pull is queued (a pull refused at once applies none)
        and before it chooses, so both records share a journal batch; the answer waits until
        the acks are as durable as ``ack`` makes them. A pull that fails later (e.g.
        ``deadline_exceeded``) has still applied its acks: sent again, they answer as
        ``unknown``. The ``AckResult`` is None when ``ack`` is.

        ``tags``: the group's tag filter, fixed by the pull that creates the group (a
        different one is ``tags_conflict``); not for ordered subjects. ``records``: the
        messages as stored (``qmq_wire.records_entry`` each), not their JSON.
        """
        self.lifecycle.require()
        if isinstance(start, str):  # "earliest" or "latest"
            start = Position(kind=start)
        if mode == "ordered" or self.ordered.ordered(subject):
            if tags:
                raise Conflict(
                    code="tags_not_ordered",
                    message="tag filters are for shared and broadcast groups, not ordered ones",
                    field="tags",
                )
            key, created = self._join_ordered(subject, group, consumer, mode, start, ack)
        else:
            key, created = self._join(subject, group, consumer, mode, start, tags)
        if created:
            # A group that starts at "latest" must not lose its start to a crash: messages
            # stored after this answer are the group's even if the broker dies now.
            await durable(self.journal.commit_point())
        future = self.pulls.submit(
            subject=subject,
            group=group,
            key=key,
            consumer=consumer,
            max_messages=max_messages,
            wait_s=wait_ms / 1000,
            min_messages=min_messages,
            linger_s=linger_ms / 1000,
            max_keys=max_keys,
            records=records,
        )
        try:
            acked = None if not ack else self._record_acks(subject, group, consumer, ack)
            if acked is not None and acked.acked:
                await durable(self.journal.commit_point())
        except BaseException:
            future.cancel()  # not served to a caller that will not read the answer
            raise
        messages: list[Served] = await future
        return messages, acked

    def charge(self, *, subject: str, group: str, measured: float, estimated: float) -> None:
        """Count work done for a group's pull outside the scheduler toward the group's share
        of the pull workers: ``measured`` (decoding the request, encoding the answer) and
        ``estimated`` (the request's part of work nobody measured: parsing, writing)."""
        self.pulls.charge(subject, group, measured, estimated)

    def measured_s(self) -> float:
        """CPU seconds of pull work measured so far: in the workers' runs and charged."""
        return self.pulls.measured_s

    def _join(
        self,
        subject: str,
        group: str,
        consumer: str,
        mode: str,
        start: Position,
        tags: list[str] | None,
    ) -> tuple[str, bool]:
        """The delivery-state key of a puller, and whether this pull created its state.

        The GROUP record that creates a group fixes its tag filter (``"tags"``, left out
        when there is none); one on a group whose filter is not fixed (after a reset) fixes
        it. Either way it is durable before the pull is answered.
        """
        found = self.groups.get((subject, group))
        if found is not None and found.mode != mode:
            raise Conflict(
                code="mode_conflict",
                message=f"group {group!r} on {subject!r} is in {found.mode} mode",
                field="mode",
            )
        wanted = tuple(sorted(tags or ()))
        if found is not None and found.tags is not None and found.tags != wanted:
            shown = list(found.tags) or "no filter"
            raise Conflict(
                code="tags_conflict",
                message=f"group {group!r} on {subject!r} filters tags {shown}: reset it first",
                field="tags",
            )
        key = consumer if mode == "broadcast" else ""
        fixing = found is not None and found.tags is None
        if found is None or key not in found.states or fixing:
            log = self.subjects.ensure(subject)
            cursor = log.seq_at(start)
            fields: dict[str, object] = {"mode": mode, "cursor": cursor}
            if wanted or fixing:
                fields["tags"] = list(wanted)
            self.actions.record(
                action(
                    ActionType.GROUP,
                    at_us=self.clock.wall_us(),
                    subject=subject,
                    group=group,
                    state=key,
                    fields=fields,
                )
            )
            return key, True
        return key, False

    def _join_ordered(
        self,
        subject: str,
        group: str,
        consumer: str,
        mode: str,
        start: Position,
        ack: list[int] | None,
    ) -> tuple[str, bool]:
        self.ordered.require_served(subject)  # a fenced subject, whatever the mode asked
        if not self.ordered.ordered(subject) and subject not in self.subjects:
            raise NotFound(
                code="subject_not_found",
                message=f"no subject {subject!r}: declare it ordered first",
                field="subject",
            )
        if not self.ordered.ordered(subject):
            raise Conflict(
                code="not_ordered",
                message=f"{subject!r} is not ordered: pull it in shared or broadcast mode",
                field="mode",
            )
        if mode != "ordered":
            raise Conflict(
                code="mode_conflict",
                message=f"{subject!r} is ordered: pull it in ordered mode",
                field="mode",
            )
        if ack:
            raise Conflict(
                code="partition_required",
                message=f"{subject!r} is ordered: ack with POST /v1/ack naming the partition",
                field="ack",
            )
        if start.kind == "seq" and not self.ordered.has_group(subject, group):
            raise Conflict(
                code="partition_required",
                message=(
                    f"{subject!r} is ordered: its seqs count per partition, so a group "
                    "starts at a time (or resets one partition to a seq)"
                ),
                field="start",
            )
        # Keyed by consumer like broadcast pulls: each consumer's long poll is woken on its
        # own (an ack unblocks the partitions of the consumer that sent it).
        return consumer, self.ordered.join(subject, group, start)

    def _log_of(self, subject: str, partition: int | None) -> str:
        """The log a consumer's ack, nack or dead-letter call is about."""
        if self.ordered.ordered(subject):
            if partition is None:
                raise Conflict(
                    code="partition_required",
                    message=f"{subject!r} is ordered: name the partition",
                    field="partition",
                )
            self.ordered.require_partition(subject, partition)
            return partition_log(subject, partition)
        if partition is not None:
            raise Conflict(
                code="not_ordered",
                message=f"{subject!r} is not ordered: it has no partitions",
                field="partition",
            )
        return subject

    def _heard_from(self, subject: str, group: str, consumer: str) -> None:
        """An ack or nack of an ordered subject: the consumer keeps its partitions, and a
        partition it unblocked may be served (to whoever holds it) now."""
        if self.ordered.ordered(subject):
            self.ordered.renew(subject, group, consumer)
            self.pulls.wake_subject(subject)

    # --- ack / nack ------------------------------------------------------------------------

    async def ack(
        self,
        *,
        subject: str,
        group: str,
        consumer: str,
        seqs: list[int],
        partition: int | None = None,
    ) -> AckResult:
        self.lifecycle.require()
        result = self._record_acks(self._log_of(subject, partition), group, consumer, seqs)
        self._heard_from(subject, group, consumer)
        if result.acked:
            await durable(self.journal.commit_point())
        return result

    def _record_acks(self, subject: str, group: str, consumer: str, seqs: list[int]) -> AckResult:
        """Append the ACK record of the seqs this consumer holds (not yet durable)."""
        state, key = self._state_of(subject, group, consumer)
        known: list[int] = []
        unknown: list[int] = []
        for seq in dict.fromkeys(seqs):
            (known if state.holds(seq, consumer) else unknown).append(seq)
        if known:
            now = self.clock.wall_us()
            self.actions.record(
                action(
                    ActionType.ACK, at_us=now, subject=subject, group=group, state=key, seqs=known
                ),
                relaxed=True,
            )
        self.metrics.acked.inc(len(known))
        return AckResult(acked=len(known), unknown=unknown)

    async def nack(
        self,
        *,
        subject: str,
        group: str,
        consumer: str,
        seqs: list[int],
        delay_ms: int | None,
        error: str | None,
        partition: int | None = None,
    ) -> NackResult:
        self.lifecycle.require()
        shown = subject
        subject = self._log_of(subject, partition)
        state, key = self._state_of(subject, group, consumer)
        now = self.clock.wall_us()
        delay_us = delay_ms * 1000 if delay_ms is not None else None
        counted = [s for s in dict.fromkeys(seqs) if state.holds(s, consumer)]
        released: list[int] = []
        if subject != shown:  # an ordered partition: one attempt per key
            counted, released = first_of_each_key(
                counted, key_of=lambda seq: self.ordered.key_of(subject, seq)
            )
        retry, dead = state.nack_outcomes(
            counted,
            consumer=consumer,
            now_us=now,
            delay_us=delay_us,
            policy=self.policy,
        )

        def record(kind: ActionType, batch: list[int], fields: dict[str, object]) -> None:
            self.actions.record(
                action(
                    kind,
                    at_us=now,
                    subject=subject,
                    group=group,
                    state=key,
                    seqs=batch,
                    fields=fields,
                ),
                relaxed=True,
            )

        retrying = len(released)
        for due, batch in sorted(retry.items()):
            record(ActionType.RETRY, batch, {"due": due, "error": error})
            retrying += len(batch)
        if released:
            record(ActionType.RETRY, released, {"due": now, "error": error, "released": True})
        if dead:
            record(ActionType.DEAD, dead, {"error": error})
        self._heard_from(shown, group, consumer)
        if retrying or dead:
            self.pulls.wake_subject(shown)
            await durable(self.journal.commit_point())
        self.metrics.nacked.inc(retrying + len(dead))
        return NackResult(retrying=retrying, dead=len(dead))

    def _state_of(self, subject: str, group: str, consumer: str) -> tuple[DeliveryState, str]:
        found = self.groups.get((subject, group))
        if found is None:
            raise NotFound(
                code="group_not_found", message=f"no group {group!r} on {subject!r}", field="group"
            )
        key = found.state_key(consumer)
        state = found.states.get(key)
        if state is None:
            raise NotFound(
                code="consumer_not_found",
                message=f"consumer {consumer!r} has not pulled from broadcast group {group!r}",
                field="consumer",
            )
        return state, key

    # --- dead letters ----------------------------------------------------------------------

    def dead_letters(
        self,
        *,
        subject: str,
        group: str,
        limit: int,
        after_seq: int | None,
        partition: int | None = None,
    ) -> DeadLetterPage:
        self.lifecycle.require(write=False)
        shown = subject
        subject = self._log_of(subject, partition)
        found = self._group(subject, group)
        rows = [
            (seq, key, dead)
            for key, state in found.states.items()
            for seq, dead in state.dead.items()
            if after_seq is None or seq > after_seq
        ]
        rows.sort(key=lambda row: (row[0], row[1]))
        page = rows[:limit]
        log = self.subjects[subject]
        views = []
        for seq, key, dead in page:
            try:
                message: PulledMessageJson | None = pulled(
                    read_message(self.reader, log, seq), attempt=dead.attempts
                )
                if partition is not None and message is not None:
                    message["subject"], message["partition"] = shown, partition
            except (StorageError, CorruptRecord, ValueError, OverflowError):
                message = None  # unreadable, or a record no answer can carry
            views.append(
                DeadLetterView(
                    seq=seq,
                    attempts=dead.attempts,
                    error=dead.error,
                    dead_at=rfc3339(dead.at_us),
                    consumer=key or None,
                    message=message,
                )
            )
        more = len(rows) > limit
        return DeadLetterPage(dead=views, next_after_seq=page[-1][0] if page and more else None)

    async def redrive(
        self, *, subject: str, group: str, seqs: list[int] | None, partition: int | None = None
    ) -> int:
        """Send dead letters (the given seqs, or all with None) back for another round."""
        self.lifecycle.require()
        shown = subject
        subject = self._log_of(subject, partition)
        found = self._group(subject, group)
        now = self.clock.wall_us()
        total = 0
        for key, state in found.states.items():
            chosen = (
                list(state.dead)
                if seqs is None
                else [s for s in dict.fromkeys(seqs) if s in state.dead]
            )
            if chosen:
                self.actions.record(
                    action(
                        ActionType.REDRIVE,
                        at_us=now,
                        subject=subject,
                        group=group,
                        state=key,
                        seqs=sorted(chosen),
                    )
                )
                total += len(chosen)
        if total:
            self.pulls.wake_subject(shown)
            await durable(self.journal.commit_point())
        return total

    def _group(self, subject: str, group: str) -> Group:
        if subject not in self.subjects:
            raise NotFound(
                code="subject_not_found", message=f"no subject {subject!r}", field="subject"
            )
        found = self.groups.get((subject, group))
        if found is None:
            raise NotFound(
                code="group_not_found", message=f"no group {group!r} on {subject!r}", field="group"
            )
        return found
