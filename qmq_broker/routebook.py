"""The broker's route tables in memory, and where each closed partition's command sits.

``RouteBook`` is the only writer of both; produce asks it where a message goes, pulls
which partitions a version has. No I/O: ``RouteService`` writes the tables to disk before
it installs them here. A subject whose table was damaged and could not be rebuilt is
fenced: still ordered (nothing of it is served as a plain subject), but every call that
needs its routes answers ``subject_fenced``, while the other subjects are served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from qmq_broker.errors import Conflict, Unavailable
from qmq_wire.ordered import logic_partition, partition_log
from qmq_wire.routes import Routes


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """Where one message of an ordered subject is stored, and where its id may already be."""

    log: str  # the partition's log name
    partition: int
    earlier: tuple[str, ...]  # logs of partitions that held its logic partition before


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """Why a subject is fenced (the message of its ``subject_fenced`` errors), the
    partitions it has on disk and the seqs of the commands found at their ends (read-only:
    listed and counted, never routed to)."""

    why: str
    partitions: tuple[int, ...]
    commands: Mapping[int, int]  # partition -> seq


class RouteBook:
    def __init__(
        self,
        routes: Mapping[str, Routes] | None = None,
        *,
        fenced: Mapping[str, Fence] | None = None,
    ) -> None:
        self._routes = dict(routes or {})
        self._fenced = dict(fenced or {})
        self._commands: dict[tuple[str, int], int] = {  # (subject, partition) -> seq
            (subject, partition): seq
            for subject, fence in self._fenced.items()
            for partition, seq in fence.commands.items()
        }

    def get(self, subject: str) -> Routes | None:
        """The subject's routes; None for a plain subject; ``subject_fenced`` if fenced."""
        fence = self._fenced.get(subject)
        if fence is not None:
            raise Unavailable(code="subject_fenced", message=fence.why, field="subject")
        return self._routes.get(subject)

    def partitions(self, subject: str) -> list[int] | None:
        """Every partition of an ordered subject, fenced or not (for reads); None if plain."""
        fence = self._fenced.get(subject)
        if fence is not None:
            return list(fence.partitions)
        routes = self._routes.get(subject)
        return None if routes is None else routes.every_partition()

    def is_ordered(self, subject: str) -> bool:
        return subject in self._routes or subject in self._fenced

    def __bool__(self) -> bool:
        """Whether any subject is ordered (produce skips routing when none is)."""
        return bool(self._routes) or bool(self._fenced)

    def subjects(self) -> list[str]:
        """The ordered subjects served (the fenced ones left out)."""
        return sorted(self._routes)

    def fenced(self) -> list[str]:
        return sorted(self._fenced)

    def target(self, subject: str, key: str | None, *, index: int) -> Target:
        """Where message ``index`` of a produce request (of ordered ``subject``) goes."""
        fence = self._fenced.get(subject)
        if fence is not None:
            field = f"messages[{index}].subject"
            raise Unavailable(code="subject_fenced", message=fence.why, field=field)
        if key is None:
            raise Conflict(
                code="key_required",
                message=f"{subject!r} is ordered: every message needs a key",
                field=f"messages[{index}].key",
            )
        routes = self._routes[subject]
        logic = logic_partition(key)
        holders = routes.holders(logic)
        return Target(
            log=partition_log(subject, holders[0]),
            partition=holders[0],
            earlier=tuple(partition_log(subject, p) for p in holders[1:]),
        )

    def command_seq(self, subject: str, partition: int) -> int | None:
        """The seq of the command message that closed a partition, once it is stored."""
        return self._commands.get((subject, partition))

    # --- changes (RouteService only) -------------------------------------------------------

    def install(self, routes: Routes) -> None:
        """Route by ``routes`` from now on (already durable on disk)."""
        self._routes[routes.subject] = routes

    def commanded(self, subject: str, partition: int, seq: int) -> None:
        """The command that closed ``partition`` is stored at ``seq``, its last."""
        self._commands[(subject, partition)] = seq
