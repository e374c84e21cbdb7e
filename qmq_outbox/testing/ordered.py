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

An ordered subject is held as its ``qmq_wire.routes.Routes``, as the broker holds it; the
helpers here name its partitions' logs.
"""

from __future__ import annotations

from collections.abc import Callable

from qmq_wire.ordered import partition_log
from qmq_wire.routes import Routes


def partition_logs(routes: Routes) -> list[tuple[int, str]]:
    """Each partition any version named, and the name of its log (``subject#p``)."""
    return [(p, partition_log(routes.subject, p)) for p in routes.every_partition()]


def open_partition_logs(routes: Routes, finished: Callable[[int], bool]) -> list[tuple[int, str]]:
    """The partitions a group consumes now, by which closed ones it ``finished``, and
    their logs: those of the route version it has reached."""
    version = routes.at(routes.group_version(finished))
    return [(p, partition_log(routes.subject, p)) for p in version.partitions]
