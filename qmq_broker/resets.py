"""Resetting a consumer group to a position: replay from a time or a seq, or skip ahead.

A reset is one RESET action record per delivery state it moves (the group in shared mode,
each consumer in broadcast mode, each partition of an ordered subject), so it is as durable
as the rest of the group's state and replay rebuilds it. It is refused (``group_busy``)
while the states it moves have messages leased out, unless forced: then those leases are
dropped, and acks of them answer ``unknown``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from qmq_broker.actions import ActionLog, action
from qmq_broker.clock import Clock
from qmq_broker.errors import Conflict, NotFound
from qmq_broker.format.actions import ActionType
from qmq_broker.groups import DeliveryState, GroupTable
from qmq_broker.lifecycle import Lifecycle, durable
from qmq_broker.pulls.ordered import OrderedPulls
from qmq_broker.storage.journal import Journal
from qmq_broker.subjects import SubjectTable
from qmq_wire.ordered import partition_log
from qmq_wire.rules import Position

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResetPosition:
    partition: int | None  # an ordered subject's partition
    consumer: str | None  # the broadcast consumer
    seq: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResetResult:
    positions: list[ResetPosition]
    dropped_leases: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """One delivery state a reset moves: its log, state key and new cursor."""

    log: str
    key: str
    partition: int | None
    state: DeliveryState | None  # None: an ordered partition the group has no state on yet


@dataclasses.dataclass(kw_only=True, eq=False)
class ResetService:
    """``POST /v1/subjects/{subject}/groups/{group}/reset``."""

    lifecycle: Lifecycle
    journal: Journal
    subjects: SubjectTable
    groups: GroupTable
    actions: ActionLog
    ordered: OrderedPulls
    clock: Clock
    wake: Callable[[str], None]

    async def reset(
        self, *, subject: str, group: str, to: Position, force: bool, partition: int | None
    ) -> ResetResult:
        """Move the group (one ``partition`` of an ordered subject) to ``to``; answered
        once the records are durable."""
        self.lifecycle.require()
        if self.ordered.ordered(subject):
            targets = self._ordered_targets(subject, group, to, partition)
        else:
            targets = self._plain_targets(subject, group, partition)
        leased = sum(len(t.state.leases) for t in targets if t.state is not None)
        if leased and not force:
            raise Conflict(
                code="group_busy",
                message=(
                    f"group {group!r} on {subject!r} has {leased} messages leased out: wait "
                    'for their acks, or reset with "force": true (their acks then answer '
                    "unknown)"
                ),
                field="force",
            )
        now = self.clock.wall_us()
        positions = []
        for target in targets:
            if target.state is None:
                assert target.partition is not None
                self.ordered.state(subject, target.partition, group, at=to)
            cursor = self.subjects[target.log].seq_at(to)
            self.actions.record(
                action(
                    ActionType.RESET,
                    at_us=now,
                    subject=target.log,
                    group=group,
                    state=target.key,
                    fields={"cursor": cursor},
                )
            )
            consumer = target.key if target.partition is None and target.key else None
            positions.append(
                ResetPosition(partition=target.partition, consumer=consumer, seq=cursor)
            )
        self.wake(subject)
        await durable(self.journal.commit_point())
        logger.info(
            "group reset",
            extra={
                "action": "broker.group_reset",
                "subject": subject,
                "group": group,
                "to": to.describe(),
                "dropped_leases": leased,
            },
        )
        return ResetResult(positions=positions, dropped_leases=leased)

    def _plain_targets(self, subject: str, group: str, partition: int | None) -> list[_Target]:
        if subject not in self.subjects:
            raise NotFound(
                code="subject_not_found", message=f"no subject {subject!r}", field="subject"
            )
        if partition is not None:
            raise Conflict(
                code="not_ordered",
                message=f"{subject!r} is not ordered: it has no partitions",
                field="partition",
            )
        found = self.groups.get((subject, group))
        if found is None:
            raise NotFound(
                code="group_not_found", message=f"no group {group!r} on {subject!r}", field="group"
            )
        return [_Target(subject, key, None, state) for key, state in sorted(found.states.items())]

    def _ordered_targets(
        self, subject: str, group: str, to: Position, partition: int | None
    ) -> list[_Target]:
        self.ordered.require_served(subject)
        if partition is not None:
            self.ordered.require_partition(subject, partition)
        if to.kind == "seq" and partition is None:
            raise Conflict(
                code="partition_required",
                message=f"{subject!r} is ordered: its seqs count per partition, name one",
                field="partition",
            )
        if not self.ordered.has_group(subject, group):
            raise NotFound(
                code="group_not_found", message=f"no group {group!r} on {subject!r}", field="group"
            )
        targets = []
        for number in self.ordered.reset_partitions(subject, group, to, partition):
            log = partition_log(subject, number)
            found = self.groups.get((log, group))
            state = None if found is None else found.states[""]
            targets.append(_Target(log, "", number, state))
        return targets
