"""The in-memory broker's state, shared by its parts: logs, groups, ordered subjects, settings.

Each part (produce, pulls, dead letters, stats, routes) reads and changes it under the
broker's one lock, and calls ``wake`` when parked long polls should look again. The lookups
here refuse as the broker does (404 for an unknown subject or group, 409 for a partition
named on the wrong kind of subject).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qmq_outbox.testing.delayed import DelayedMessages
from qmq_outbox.testing.delivery import DeliveryState, GroupState
from qmq_outbox.testing.logs import SubjectLog, log_name
from qmq_wire.delivery import RetryPolicy
from qmq_wire.routes import Routes
from qmq_wire.rules import Refused


@dataclasses.dataclass(slots=True, kw_only=True)
class BrokerState:
    policy: RetryPolicy
    max_body: int
    max_delay_us: int
    clock: Callable[[], float]
    wake: Callable[[], None]
    logs: dict[str, SubjectLog] = dataclasses.field(default_factory=dict)
    """By log name: a plain subject, or an ordered subject's partition (``subject#p``)."""
    groups: dict[tuple[str, str], GroupState] = dataclasses.field(default_factory=dict)
    """By (log name, group name)."""
    ordered: dict[str, Routes] = dataclasses.field(default_factory=dict)
    delayed: DelayedMessages = dataclasses.field(default_factory=DelayedMessages)

    def now_us(self) -> int:
        return round(self.clock() * 1_000_000)

    def log(self, name: str) -> SubjectLog:
        """The log ``name``, made empty when first needed (as the broker makes its files)."""
        log = self.logs.get(name)
        if log is None:
            log = self.logs[name] = SubjectLog(name)
        return log

    def log_of(self, subject: str, partition: int | None) -> str:
        """The log an ack, nack or dead-letter call is about: an ordered subject's partition
        must be named, a plain subject's must not."""
        if subject in self.ordered:
            if partition is None:
                message = f"{subject!r} is ordered: name the partition"
                raise Refused("partition_required", message, "partition")
            return log_name(subject, partition)
        if partition is not None:
            message = f"{subject!r} is not ordered: it has no partitions"
            raise Refused("not_ordered", message, "partition")
        return subject

    def group(self, subject: str, name: str, partition: int | None) -> tuple[str, GroupState]:
        """The log of ``subject`` (its ``partition``'s, if ordered) and ``name``'s group there."""
        if subject not in self.logs and subject not in self.ordered:
            raise Refused("subject_not_found", f"no subject {subject!r}", "subject")
        log = self.log_of(subject, partition)
        group = self.groups.get((log, name))
        if group is None:
            raise Refused("group_not_found", f"no group {name!r} on {log!r}", "group")
        return log, group

    def owner(self, doc: dict[str, Any]) -> DeliveryState:
        """The state an ack or nack of ``doc`` (subject, group, consumer, partition) is about."""
        name, consumer = doc["group"], doc["consumer"]
        log = self.log_of(doc["subject"], doc.get("partition"))
        group = self.groups.get((log, name))
        if group is None:
            raise Refused("group_not_found", f"no group {name!r} on {log!r}", "group")
        owner = group.owners.get(group.owner_key(consumer))
        if owner is None:
            message = f"consumer {consumer!r} has not pulled from broadcast group {name!r}"
            raise Refused("consumer_not_found", message, "consumer")
        return owner

    def owners(self, subject: str, group: str, partition: int | None) -> list[DeliveryState]:
        """Every state owner of ``group`` on a log (none before its first pull)."""
        found = self.groups.get((log_name(subject, partition), group))
        return [] if found is None else list(found.owners.values())

    def release_due(self) -> None:
        """Store the delayed messages whose time came, in due order."""
        now = self.now_us()
        for delayed in self.delayed.take_due(now):
            self.log(delayed.envelope["subject"]).append(
                delayed.envelope,
                delayed.body,
                created_default_us=delayed.created_at_us,
                now_us=now,
                partition=None,
            )
