"""Ordered pulls: which partitions a group sees, who holds each, what a pull may lease.

Runs on the event loop inside the group's actor, like ``PullService._decide``: every group
state change is an action record on the partition's log (state key ``""``, shared), so a
restart rebuilds the same states, and the group's route version is derived from them:
version v + 1 once every partition closed by that change was consumed up to its command.

Partition leases (which consumer holds which partition) live only in memory: after a
restart consumers take partitions anew, and the message leases, which are durable, keep
a partition's order meanwhile.

Inside a partition, keys run side by side up to the pull's ``max_keys`` (``keyed.py``);
``max_keys`` 1 serves the partition one batch at a time, the next once it is all acked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

from qmq_broker.actions import ActionLog, action
from qmq_broker.clock import Clock
from qmq_broker.errors import CorruptRecord, NotFound, StorageError
from qmq_broker.format.actions import ActionType
from qmq_broker.groups import DeliveryState, GroupTable, Policy
from qmq_broker.pulls.reads import Batch, read_message
from qmq_broker.pulls.request import QueuedPull
from qmq_broker.routebook import RouteBook
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectTable
from qmq_wire.keyed import choose_keyed
from qmq_wire.ordered import COMMAND_PRODUCER, partition_log
from qmq_wire.routes import Routes
from qmq_wire.rules import Position

SHARED = ""
REBALANCE_CHECK_S = 0.1  # a consumer short of its share looks again this soon
KEY_CACHE_SIZE = 20_000  # keys remembered per partition log, then forgotten: skipped + look-ahead


@dataclasses.dataclass(slots=True)
class _Lease:
    consumer: str
    until: float  # scheduler clock


@dataclasses.dataclass(slots=True)
class _GroupView:
    leases: dict[int, _Lease] = dataclasses.field(default_factory=dict)
    seen: dict[str, float] = dataclasses.field(default_factory=dict)  # consumer -> last call
    turn: int = 0  # rotates which held partition a pull serves first


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class OrderedPulls:
    """Decisions for ``"mode": "ordered"`` pulls; the only owner of partition leases."""

    book: RouteBook
    subjects: SubjectTable
    groups: GroupTable
    actions: ActionLog
    policy: Policy
    clock: Clock
    lease_s: float
    reader: SegmentReader
    # log -> seq -> the message's key
    _keys: dict[str, dict[int, Hashable]] = dataclasses.field(init=False, default_factory=dict)
    _views: dict[tuple[str, str], _GroupView] = dataclasses.field(init=False, default_factory=dict)

    def ordered(self, subject: str) -> bool:
        return self.book.is_ordered(subject)

    def require_served(self, subject: str) -> None:
        """``subject_fenced`` when the subject's routes could not be recovered."""
        self.book.get(subject)

    def require_partition(self, subject: str, partition: int) -> None:
        """``partition_not_found`` unless ``partition`` is one of the subject's."""
        if partition not in self._routes(subject).every_partition():
            raise NotFound(
                code="partition_not_found",
                message=f"{subject!r} has no partition {partition}",
                field="partition",
            )

    # --- joining ---------------------------------------------------------------------------

    def join(self, subject: str, group: str, start: Position) -> bool:
        """Make the group's first states if it has none; True when this call made them.

        ``earliest``: the partitions of route version 1, from their first seqs. ``latest``
        or a time: every partition, at its end or at its first message stored at or after
        that time, so partitions closed before it count as finished.
        """
        if self.has_group(subject, group):
            return False
        for partition in self.reset_partitions(subject, group, start, None):
            self.state(subject, partition, group, at=start)
        return True

    def has_group(self, subject: str, group: str) -> bool:
        """Whether ``group`` ever pulled from the ordered ``subject``."""
        routes = self._routes(subject)
        return (partition_log(subject, routes.at(1).partitions[0]), group) in self.groups

    def reset_partitions(
        self, subject: str, group: str, to: Position, partition: int | None
    ) -> list[int]:
        """The partitions a group joining or reset at ``to`` reads from there: ``partition``
        alone if named; for ``earliest`` those of version 1 and any the group has a state
        on (the others start at their first seqs when the group reaches them); else all."""
        if partition is not None:
            return [partition]
        routes = self._routes(subject)
        if to.kind != "earliest":
            return sorted(routes.every_partition())
        return sorted(
            p
            for p in routes.every_partition()
            if p in routes.at(1).partitions or (partition_log(subject, p), group) in self.groups
        )

    def renew(self, subject: str, group: str, consumer: str) -> None:
        """An ack or nack from ``consumer``: it is alive, its partitions stay its own."""
        view = self._views.get((subject, group))
        if view is None:
            return
        now = self.clock.now()
        view.seen[consumer] = now
        for lease in view.leases.values():
            if lease.consumer == consumer:
                lease.until = now + self.lease_s

    # --- deciding a pull --------------------------------------------------------------------

    def decide(self, request: QueuedPull) -> tuple[list[Batch], float | None]:
        """What to lease for ``request`` now (batches of one partition each, in the order to
        serve them), and when to look again if nothing (scheduler clock)."""
        subject, group, consumer = request.subject, request.group, request.consumer
        routes = self._routes(subject)
        now, now_us = self.clock.now(), self.clock.wall_us()
        view = self._views.setdefault((subject, group), _GroupView())
        view.seen[consumer] = now
        _, visible = self._visible(routes, group, now_us)
        held = self._assign(routes, group, visible, consumer, now)
        batches: list[Batch] = []
        if held:
            view.turn += 1
            start = view.turn % len(held)
            limit = request.max_messages
            ready = [
                (partition, found)
                for partition in held[start:] + held[:start]
                if (found := self._next_seqs(routes, partition, group, request, now_us))
            ]
            shares = share_out(limit, [len(found[0]) for _, found in ready])
            for (partition, (seqs, attempts)), share in zip(ready, shares, strict=True):
                if share:
                    taken = seqs[:share], attempts[:share]
                    batches.append(
                        self._lease(
                            routes, partition, group, consumer, *taken, now_us, request.records
                        )
                    )
        if batches:
            return batches, None
        short = len(held) < math.ceil(len(visible) / max(len(view.seen), 1))
        return [], self._wake_at(routes, group, held, view, consumer, short, now, now_us)

    def group_version(self, subject: str, group: str) -> int:
        """The route version whose partitions ``group`` consumes (1 before it pulled)."""
        routes = self._routes(subject)
        if not self.has_group(subject, group):
            return 1
        return routes.group_version(lambda p: self._finished(routes, p, group))

    def groups_of(self, subject: str) -> list[str]:
        """The groups that ever pulled from ``subject``."""
        routes = self._routes(subject)
        logs = {partition_log(subject, p) for p in routes.every_partition()}
        return sorted({group for (log, group) in self.groups if log in logs})

    def partition_owners(self, subject: str) -> dict[str, dict[int, tuple[str, float]]]:
        """Read-only, for operators: per group, each partition whose lease is live now, with
        its consumer and the seconds left on the lease (renewed by that consumer's calls)."""
        now = self.clock.now()
        return {
            group: {
                partition: (lease.consumer, lease.until - now)
                for partition, lease in sorted(view.leases.items())
                if lease.until > now
            }
            for (name, group), view in sorted(self._views.items())
            if name == subject
        }

    # --- the group's partitions -------------------------------------------------------------

    def _visible(self, routes: Routes, group: str, now_us: int) -> tuple[int, list[int]]:
        """The group's route version and its unfinished partitions, after expiring message
        leases and consuming every command whose turn has come."""
        version = 1
        while True:
            unfinished = []
            for partition in routes.at(version).partitions:
                state = self.state(routes.subject, partition, group)
                self._expire(routes.subject, partition, group, state, now_us)
                self._consume_command(routes, partition, group, state, now_us)
                if not self._finished(routes, partition, group):
                    unfinished.append(partition)
            if not routes.advances(version, lambda p: self._finished(routes, p, group)):
                return version, unfinished
            version += 1

    def _finished(self, routes: Routes, partition: int, group: str) -> bool:
        """Whether ``group`` consumed ``partition`` up to and including its command."""
        command = self.book.command_seq(routes.subject, partition)
        if command is None:
            return False
        found = self.groups.get((partition_log(routes.subject, partition), group))
        if found is None:
            return False
        state = found.states[SHARED]
        return (
            state.cursor > command
            and not state.leases
            and not state.retries
            and not state.skipped
            and (routes.on_dead == "skip" or not state.dead)
        )

    def _consume_command(
        self, routes: Routes, partition: int, group: str, state: DeliveryState, now_us: int
    ) -> None:
        """Lease and ack a partition's command for the group once everything before it is
        acked: the partition is finished for the group."""
        command = self.book.command_seq(routes.subject, partition)
        if (
            command is None
            or state.cursor != command
            or state.retries
            or state.skipped
            or self._blocked(routes, state)
        ):
            return
        log = partition_log(routes.subject, partition)
        fields = {"consumer": COMMAND_PRODUCER, "deadline": now_us, "attempts": [1]}
        self.actions.record(
            _action(ActionType.LEASE, now_us, log, group, [command], fields), relaxed=True
        )
        self.actions.record(
            _action(ActionType.ACK, now_us, log, group, [command], {}), relaxed=True
        )

    def _assign(
        self, routes: Routes, group: str, visible: list[int], consumer: str, now: float
    ) -> list[int]:
        """The partitions ``consumer`` holds after this pull: its own, renewed; beyond its
        share, those with nothing in flight given back; free ones taken up to its share."""
        view = self._views[(routes.subject, group)]
        for partition, lease in list(view.leases.items()):
            if lease.until <= now or partition not in visible:
                del view.leases[partition]
        for name, seen in list(view.seen.items()):
            if seen + self.lease_s <= now:
                del view.seen[name]
        share = math.ceil(len(visible) / max(len(view.seen), 1))
        held = [p for p in visible if p in view.leases and view.leases[p].consumer == consumer]
        kept: list[int] = []
        for partition in held:
            in_flight = self.state(routes.subject, partition, group).leases
            if len(kept) < share or in_flight:
                view.leases[partition].until = now + self.lease_s
                kept.append(partition)
            else:
                del view.leases[partition]  # beyond its share: another consumer's turn
        for partition in visible:
            if len(kept) >= share:
                break
            if partition not in view.leases:
                view.leases[partition] = _Lease(consumer, now + self.lease_s)
                kept.append(partition)
        return sorted(kept)

    # --- one partition ----------------------------------------------------------------------

    def _blocked(self, routes: Routes, state: DeliveryState) -> bool:
        return bool(state.leases) or (routes.on_dead == "block" and bool(state.dead))

    def _next_seqs(
        self, routes: Routes, partition: int, group: str, request: QueuedPull, now_us: int
    ) -> tuple[list[int], list[int]] | None:
        """The partition's next batch, up to the request's ``max_messages``, and each one's
        attempt, up to its command. With ``max_keys`` 1 (and nothing skipped): its due
        retries in seq order if it has retries, else new messages; nothing while anything
        is leased. Otherwise per key (``choose_keyed``)."""
        subject = routes.subject
        log_name = partition_log(subject, partition)
        log = self.subjects[log_name]
        state = self.state(subject, partition, group)
        state.skip_below(log.first_seq)
        gone = [seq for seq in state.retries if seq < log.first_seq]
        if gone:
            error = "removed by retention before it was acknowledged"
            self.actions.record(
                _action(ActionType.DEAD, now_us, log_name, group, gone, {"error": error})
            )
        command = self.book.command_seq(subject, partition)
        end = log.end_seq if command is None else min(log.end_seq, command)
        limit = request.max_messages
        if request.max_keys > 1 or state.skipped:
            seqs, attempts = choose_keyed(
                state,
                key_of=lambda seq: self.key_of(log_name, seq),
                limit=limit,
                max_keys=request.max_keys,
                end=end,
                now_us=now_us,
                block_dead=routes.on_dead == "block",
            )
            return (seqs, attempts) if seqs else None
        if self._blocked(routes, state):
            return None
        seqs = []
        attempts = []
        if state.retries:
            for seq in sorted(state.retries):
                retry = state.retries[seq]
                if retry.due_us > now_us or len(seqs) >= limit:
                    break  # the oldest retry not due yet holds back everything after it
                seqs.append(seq)
                attempts.append(retry.attempts + 1)
        else:
            seqs = list(range(state.cursor, min(end, state.cursor + limit)))
            attempts = [1] * len(seqs)
        return (seqs, attempts) if seqs else None

    def key_of(self, log_name: str, seq: int) -> Hashable:
        """The key of a stored message (read once, then remembered); an unreadable one is
        a key of its own, so that the pull serves it and the read reports the damage."""
        keys = self._keys.setdefault(log_name, {})
        if seq not in keys:
            if len(keys) >= KEY_CACHE_SIZE:
                keys.clear()
            try:
                keys[seq] = read_message(self.reader, self.subjects[log_name], seq).key
            except (StorageError, CorruptRecord, ValueError, OverflowError):
                keys[seq] = ("unreadable", seq)
        return keys[seq]

    def _lease(
        self,
        routes: Routes,
        partition: int,
        group: str,
        consumer: str,
        seqs: list[int],
        attempts: list[int],
        now_us: int,
        records: bool,
    ) -> Batch:
        """Lease ``seqs`` of the partition to ``consumer``: a batch to serve (``records``:
        as stored)."""
        subject = routes.subject
        log_name = partition_log(subject, partition)
        log = self.subjects[log_name]
        positions = log.positions(seqs)
        fields = {
            "consumer": consumer,
            "deadline": now_us + self.policy.ack_timeout_us,
            "attempts": attempts,
        }
        self.actions.record(
            _action(ActionType.LEASE, now_us, log_name, group, seqs, fields), relaxed=True
        )
        return Batch(
            subject=log_name,
            seqs=seqs,
            attempts=attempts,
            positions=positions,
            now_us=now_us,
            shown_as=(subject, partition),
            records=records,
        )

    def _expire(
        self, subject: str, partition: int, group: str, state: DeliveryState, now_us: int
    ) -> None:
        log = partition_log(subject, partition)
        for kind, seqs, fields in state.expire(now_us=now_us, policy=self.policy):
            self.actions.record(_action(kind, now_us, log, group, seqs, fields))

    def state(
        self, subject: str, partition: int, group: str, *, at: Position | None = None
    ) -> DeliveryState:
        """The group's state on a partition, made (durably recorded) when first needed, at
        ``at`` (its first seq by default)."""
        log_name = partition_log(subject, partition)
        found = self.groups.get((log_name, group))
        if found is None:
            log = self.subjects.ensure(log_name)
            cursor = log.first_seq if at is None else log.seq_at(at)
            fields = {"mode": "shared", "cursor": cursor}
            self.actions.record(
                _action(ActionType.GROUP, self.clock.wall_us(), log_name, group, [], fields)
            )
            found = self.groups[(log_name, group)]
        return found.states[SHARED]

    def _wake_at(
        self,
        routes: Routes,
        group: str,
        held: list[int],
        view: _GroupView,
        consumer: str,
        short: bool,
        now: float,
        now_us: int,
    ) -> float | None:
        """When a parked pull of ``consumer`` should look again without new data: a retry
        of a held partition coming due, a message lease expiring, another consumer's
        partition lease running out, and soon when it holds less than its share (the others
        give back what they hold beyond theirs at their next pull)."""
        times: list[float] = []
        for partition in held:
            wakeup = self.state(routes.subject, partition, group).next_wakeup_us()
            if wakeup is not None:
                times.append(now + max((wakeup - now_us) / 1_000_000, 0.001))
        others = [lease.until for lease in view.leases.values() if lease.consumer != consumer]
        times.extend(others)
        if others and short:
            times.append(now + REBALANCE_CHECK_S)
        return min(times) if times else None

    def _routes(self, subject: str) -> Routes:
        routes = self.book.get(subject)
        assert routes is not None, f"{subject!r} is not ordered"
        return routes


def _action(
    kind: ActionType, now: int, log: str, group: str, seqs: list[int], fields: dict[str, Any]
) -> Any:
    return action(kind, at_us=now, subject=log, group=group, state=SHARED, seqs=seqs, fields=fields)


def share_out(limit: int, wants: list[int]) -> list[int]:
    """Split ``limit`` messages over partitions that have ``wants`` each: as evenly as
    their wants allow (what one cannot use goes to the others), earlier ones first on a
    remainder. One pull then starts every partition a consumer holds, each on a worker of
    its own, rather than the first alone."""
    shares = [0] * len(wants)
    left = limit
    for place, n in enumerate(sorted(range(len(wants)), key=lambda i: (wants[i], i))):
        shares[n] = min(wants[n], math.ceil(left / (len(wants) - place)))
        left -= shares[n]
    return shares
