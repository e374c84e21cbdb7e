"""An ordered subject's route table: versions of logic ranges over physical partitions.

Pure logic (after QMQ's ordered messages): a fixed number of logic partitions, mapped by
contiguous ranges onto physical partitions; every change makes the next version, changes
one thing (split one partition, merge two adjacent ones, move one), and closes the
partitions it replaces. ``Routes`` is immutable: a change returns a new table, so the
service can write it to disk before anyone routes by it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from qmq_wire import OnDead, RouteChange, RouteRangeJson, RoutesAnswerJson
from qmq_wire.ordered import LOGIC_PARTITIONS, MAX_PARTITIONS

ROUTES_FORMAT = 1


class RouteConflict(Exception):
    """A route change that breaks a rule; ``field`` names the request field at fault."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """Logic partitions ``[lo, hi)`` stored in physical partition ``partition``."""

    lo: int
    hi: int
    partition: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RouteVersion:
    version: int
    change: RouteChange
    ranges: tuple[Range, ...]  # contiguous, ascending, covering [0, LOGIC_PARTITIONS)
    closed: tuple[int, ...]  # partitions this change closed (none for "create")

    @property
    def partitions(self) -> tuple[int, ...]:
        return tuple(r.partition for r in self.ranges)

    def partition_of(self, logic: int) -> int:
        """The physical partition that stores logic partition ``logic`` at this version."""
        at = bisect.bisect_right([r.lo for r in self.ranges], logic) - 1
        return self.ranges[at].partition

    def range_of(self, partition: int, *, field: str) -> tuple[int, Range]:
        for at, found in enumerate(self.ranges):
            if found.partition == partition:
                return at, found
        raise RouteConflict(
            f"partition {partition} is not open at route version {self.version}", field=field
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Routes:
    """Every version of one ordered subject's routes, oldest first."""

    subject: str
    on_dead: OnDead
    versions: tuple[RouteVersion, ...]

    @classmethod
    def create(cls, subject: str, *, partitions: int, on_dead: OnDead) -> Routes:
        """Version 1: the logic partitions split evenly over partitions 0..N-1."""
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1..{MAX_PARTITIONS}")
        bounds = [n * LOGIC_PARTITIONS // partitions for n in range(partitions + 1)]
        ranges = tuple(Range(bounds[n], bounds[n + 1], n) for n in range(partitions))
        first = RouteVersion(version=1, change="create", ranges=ranges, closed=())
        return cls(subject=subject, on_dead=on_dead, versions=(first,))

    @property
    def current(self) -> RouteVersion:
        return self.versions[-1]

    def at(self, version: int) -> RouteVersion:
        return self.versions[version - 1]

    def next_partition(self) -> int:
        return 1 + max(p for v in self.versions for p in v.partitions)

    def every_partition(self) -> list[int]:
        """Every physical partition any version named, ascending."""
        return sorted({p for v in self.versions for p in v.partitions})

    def closed(self) -> dict[int, int]:
        """Closed partition -> the version whose change closed it."""
        return {p: v.version for v in self.versions for p in v.closed}

    def holders(self, logic: int) -> list[int]:
        """Every partition that ever stored logic partition ``logic``, newest first (where a
        resent id may already be)."""
        seen: dict[int, None] = {}
        for version in reversed(self.versions):
            seen.setdefault(version.partition_of(logic), None)
        return list(seen)

    def advances(self, version: int, finished: Callable[[int], bool]) -> bool:
        """Whether a group moves past ``version``: a newer one exists and the group
        ``finished`` (consumed up to its command) every partition that change closed."""
        return version < self.current.version and all(
            finished(p) for p in self.at(version + 1).closed
        )

    def group_version(self, finished: Callable[[int], bool]) -> int:
        """The version whose partitions a group consumes, by what it ``finished``."""
        version = 1
        while self.advances(version, finished):
            version += 1
        return version

    def document(self, group_versions: Mapping[str, int]) -> RoutesAnswerJson:
        """The routes document (``GET /v1/subjects/{subject}/routes``), with each group's
        route version."""
        return {
            "subject": self.subject,
            "ordered": True,
            "logic_partitions": LOGIC_PARTITIONS,
            "on_dead": self.on_dead,
            "version": self.current.version,
            "ranges": ranges_json(self.current.ranges),
            "history": [
                {
                    "version": v.version,
                    "change": v.change,
                    "ranges": ranges_json(v.ranges),
                    "closed": list(v.closed),
                }
                for v in self.versions
            ],
            "groups": [
                {"group": group, "version": version}
                for group, version in sorted(group_versions.items())
            ],
        }

    # --- changes ---------------------------------------------------------------------------

    def split(self, partition: int, at: int) -> Routes:
        """``partition``'s range [lo, hi) becomes [lo, at) and [at, hi) on two new ones."""
        current = self.current
        index, old = current.range_of(partition, field="partition")
        if not old.lo < at < old.hi:
            raise RouteConflict(
                f"at must lie inside partition {partition}'s range: {old.lo} < at < {old.hi}",
                field="at",
            )
        first = self.next_partition()
        replaced = (Range(old.lo, at, first), Range(at, old.hi, first + 1))
        return self._changed("split", index, index + 1, replaced, (partition,))

    def merge(self, partitions: Iterable[int]) -> Routes:
        """Two partitions with adjacent ranges become one new partition."""
        pair = list(partitions)
        if len(pair) != 2 or pair[0] == pair[1]:
            raise RouteConflict("merge takes two different partitions", field="partitions")
        current = self.current
        found = sorted(current.range_of(p, field="partitions") for p in pair)
        (low_at, low), (high_at, high) = found
        if high_at != low_at + 1:
            raise RouteConflict(
                f"partitions {pair[0]} and {pair[1]} do not hold adjacent ranges",
                field="partitions",
            )
        merged = (Range(low.lo, high.hi, self.next_partition()),)
        return self._changed("merge", low_at, high_at + 1, merged, (low.partition, high.partition))

    def move(self, partition: int) -> Routes:
        """The same range on a new partition (closing the old one)."""
        index, old = self.current.range_of(partition, field="partition")
        moved = (Range(old.lo, old.hi, self.next_partition()),)
        return self._changed("move", index, index + 1, moved, (partition,))

    def _changed(
        self,
        change: RouteChange,
        start: int,
        stop: int,
        replaced: tuple[Range, ...],
        closed: tuple[int, ...],
    ) -> Routes:
        ranges = self.current.ranges
        version = RouteVersion(
            version=self.current.version + 1,
            change=change,
            ranges=ranges[:start] + replaced + ranges[stop:],
            closed=closed,
        )
        return dataclasses.replace(self, versions=(*self.versions, version))

    # --- the on-disk document --------------------------------------------------------------

    def to_doc(self) -> dict[str, Any]:
        return {
            "format": ROUTES_FORMAT,
            "subject": self.subject,
            "on_dead": self.on_dead,
            "versions": [
                {
                    "version": v.version,
                    "change": v.change,
                    "ranges": [[r.lo, r.hi, r.partition] for r in v.ranges],
                    "closed": list(v.closed),
                }
                for v in self.versions
            ],
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Routes:
        """A table read from disk, checked against every rule (ValueError if it breaks one)."""
        if doc.get("format") != ROUTES_FORMAT:
            raise ValueError(f"unknown routes format {doc.get('format')!r}")
        versions = tuple(
            RouteVersion(
                version=int(v["version"]),
                change=v["change"],
                ranges=tuple(Range(int(lo), int(hi), int(p)) for lo, hi, p in v["ranges"]),
                closed=tuple(int(p) for p in v["closed"]),
            )
            for v in doc["versions"]
        )
        routes = cls(subject=str(doc["subject"]), on_dead=doc["on_dead"], versions=versions)
        problem = routes.problem()
        if problem is not None:
            raise ValueError(problem)
        return routes

    def problem(self) -> str | None:
        """The first rule this table breaks, if any (for tables read from disk, and tests)."""
        if self.on_dead not in ("skip", "block"):
            return f"on_dead {self.on_dead!r}"
        closed_so_far: set[int] = set()
        for number, version in enumerate(self.versions, 1):
            if version.version != number:
                return f"versions are not consecutive at {version.version}"
            ranges = version.ranges
            if not ranges or ranges[0].lo != 0 or ranges[-1].hi != LOGIC_PARTITIONS:
                return f"version {number} does not cover 0..{LOGIC_PARTITIONS}"
            if any(a.hi != b.lo for a, b in itertools.pairwise(ranges)):
                return f"version {number} has ranges that are not contiguous"
            if any(r.lo >= r.hi for r in ranges):
                return f"version {number} has an empty range"
            if len(set(version.partitions)) != len(ranges):
                return f"version {number} maps two ranges to one partition"
            if closed_so_far & set(version.partitions):
                return f"version {number} routes to a closed partition"
            if number > 1:
                before = set(self.versions[number - 2].partitions)
                if not set(version.closed) <= before or not version.closed:
                    return f"version {number} closes partitions that were not open"
            closed_so_far |= set(version.closed)
        return None


def ranges_json(ranges: tuple[Range, ...]) -> list[RouteRangeJson]:
    """Ranges as the routes document and command messages give them."""
    return [{"lo": r.lo, "hi": r.hi, "partition": r.partition} for r in ranges]
