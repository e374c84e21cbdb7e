"""Read-only views for operators: subjects, their groups, delayed messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from broker.delayed.service import DelayedMessages, ScheduledCount, ScheduleStats
from broker.errors import NotFound
from broker.gate import Gate
from broker.groups import GroupStats, GroupTable
from broker.subjects import SubjectLog, SubjectStats, SubjectTable


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SubjectDetail:
    """One subject's counters, its delayed messages and its groups."""

    subject: str
    messages: int
    bytes: int
    first_seq: int
    next_seq: int
    scheduled: ScheduledCount
    groups: list[GroupStats]


class StatsService:
    def __init__(
        self, *, gate: Gate, subjects: SubjectTable, groups: GroupTable, delayed: DelayedMessages
    ) -> None:
        self._gate = gate
        self._subjects = subjects
        self._groups = groups
        self._delayed = delayed

    def subjects(self) -> list[SubjectStats]:
        self._gate.require(write=False)
        return [self._subjects[name].stats() for name in sorted(self._subjects)]

    def subject(self, name: str) -> SubjectDetail:
        self._gate.require(write=False)
        log = self._subjects.get(name)
        if log is None and self._delayed.knows(name):
            log = SubjectLog(name, self._subjects.reader, None)  # only delayed messages so far
        if log is None:
            raise NotFound(
                code="subject_not_found", message=f"no subject {name!r}", field="subject"
            )
        stats = log.stats()
        return SubjectDetail(
            subject=stats.subject,
            messages=stats.messages,
            bytes=stats.bytes,
            first_seq=stats.first_seq,
            next_seq=stats.next_seq,
            scheduled=self._delayed.subject_stats(name),
            groups=[group.stats(log.end_seq) for group in self._groups.of_subject(name)],
        )

    def schedule(self, *, limit: int) -> ScheduleStats:
        """Pending delayed messages by hour, next due time, dispatch lag."""
        self._gate.require(write=False)
        return self._delayed.stats(limit=limit)

    def group_backlogs(self) -> Iterator[tuple[str, str, GroupStats]]:
        """Every group's counters, for the metrics."""
        for (subject, name), group in self._groups.items():
            log = self._subjects.get(subject)
            if log is not None:
                yield subject, name, group.stats(log.end_seq)
