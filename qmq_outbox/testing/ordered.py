"""Ordered subjects in the in-memory broker (``docs/architecture.md`` section 3.6), simply.

Kept: the declaration and its routes, by the broker's own route rules (``qmq_wire.routes``:
split, merge and move make the next version and close what they replace, refused as the
broker refuses them); keys routed by ``qmq_wire.logic_partition`` at the current version;
a resend found in any partition that held its key (``duplicate``); seqs per partition;
ordered pulls that serve each partition in seq order one batch at a time; a group that
moves to the next route version once it consumed every partition the change closed, so a
new partition stays invisible to it until then; acks, nacks, dead letters and redrive
naming the partition, ``on_dead``, the broker's error codes.
Left out: command messages (a closed partition is finished for a group once everything in
it is acked; the broker appends a command the group never sees, to the same effect), and
partition leases: a partition with nothing in flight goes to whichever consumer of the
group pulls first, which keeps each partition's order but not its consumer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from qmq_wire import OnDead, RoutesAnswerJson
from qmq_wire.ordered import logic_partition, partition_log
from qmq_wire.routes import Routes


@dataclasses.dataclass(frozen=True, slots=True)
class OrderedSubject:
    """One declared ordered subject and its routes (replaced whole by a change)."""

    routes: Routes

    @classmethod
    def create(cls, name: str, *, partitions: int, on_dead: OnDead) -> OrderedSubject:
        return cls(Routes.create(name, partitions=partitions, on_dead=on_dead))

    @property
    def name(self) -> str:
        return self.routes.subject

    @property
    def on_dead(self) -> OnDead:
        return self.routes.on_dead

    @property
    def partitions(self) -> int:
        """How many partitions it was declared with (version 1's)."""
        return len(self.routes.at(1).partitions)

    def partition_of(self, key: str) -> int:
        """Where a new message with ``key`` goes: its logic partition's, now."""
        return self.routes.current.partition_of(logic_partition(key))

    def holders(self, key: str) -> list[int]:
        """Every partition that ever held ``key``'s logic partition (where a resent id may be)."""
        return self.routes.holders(logic_partition(key))

    def logs(self) -> list[tuple[int, str]]:
        """Each partition any version named, and the name of its log (``subject#p``)."""
        return [(p, partition_log(self.name, p)) for p in self.routes.every_partition()]

    def open_for(self, finished: Callable[[int], bool]) -> list[tuple[int, str]]:
        """The partitions a group consumes now, by which closed ones it ``finished``, and
        their logs: those of the route version it has reached."""
        version = self.routes.at(self.routes.group_version(finished))
        return [(p, partition_log(self.name, p)) for p in version.partitions]

    def changed(self, change: Callable[[Routes], Routes]) -> OrderedSubject:
        """The subject after a route change (``RouteConflict`` if it breaks a rule)."""
        return OrderedSubject(change(self.routes))

    def document(self, group_versions: dict[str, int]) -> RoutesAnswerJson:
        return self.routes.document(group_versions)
