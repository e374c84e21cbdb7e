"""Ordered subjects in the in-memory broker (``docs/architecture.md`` section 3.6), simply.

Kept: the declaration and its routes document (version 1: the 1,024 logic partitions split
evenly over the declared partitions), keys routed by ``qmq_wire.logic_partition``, seqs per
partition, ordered pulls that serve each partition in seq order one batch at a time, acks,
nacks, dead letters and redrive naming the partition, ``on_dead``, the broker's error codes.
Left out: route changes (``split_partition``, ``merge_partitions`` and ``move_partition``
raise ``NotImplementedError``: test them against a real broker), hence command messages and
group versions beyond 1; and partition leases: a partition with nothing in flight goes to
whichever consumer of the group pulls first, which keeps each partition's order but not
its consumer.
"""

from __future__ import annotations

import dataclasses

from qmq_wire import OnDead, RouteRangeJson, RoutesAnswerJson
from qmq_wire.ordered import LOGIC_PARTITIONS, logic_partition, partition_log

ROUTE_CHANGES_REFUSED = (
    "InMemoryBroker does not change routes (split, merge, move): "
    "test route changes against a real broker"
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OrderedSubject:
    """One declared ordered subject."""

    name: str
    partitions: int
    on_dead: OnDead

    @property
    def ranges(self) -> list[RouteRangeJson]:
        """Version 1's ranges, as the broker splits them."""
        bounds = [n * LOGIC_PARTITIONS // self.partitions for n in range(self.partitions + 1)]
        return [
            {"lo": bounds[n], "hi": bounds[n + 1], "partition": n} for n in range(self.partitions)
        ]

    def partition_of(self, key: str) -> int:
        logic = logic_partition(key)
        return next(r["partition"] for r in self.ranges if r["lo"] <= logic < r["hi"])

    def logs(self) -> list[tuple[int, str]]:
        """Each partition and the name of its log (``subject#p``)."""
        return [(p, partition_log(self.name, p)) for p in range(self.partitions)]

    def document(self, groups: list[str]) -> RoutesAnswerJson:
        """The routes document; every group is at version 1 (routes never change here)."""
        ranges = self.ranges
        return {
            "subject": self.name,
            "ordered": True,
            "logic_partitions": LOGIC_PARTITIONS,
            "on_dead": self.on_dead,
            "version": 1,
            "ranges": ranges,
            "history": [{"version": 1, "change": "create", "ranges": ranges, "closed": []}],
            "groups": [{"group": group, "version": 1} for group in sorted(groups)],
        }
