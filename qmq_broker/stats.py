"""Read-only views for operators: subjects, their groups, delayed messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TypeVar

from qmq_broker.delayed.service import DelayedMessages, ScheduledCount, ScheduleStats
from qmq_broker.errors import NotFound
from qmq_broker.groups import DeliveryState, GroupStats, GroupTable
from qmq_broker.lifecycle import Lifecycle
from qmq_broker.routebook import RouteBook
from qmq_broker.subjects import SubjectLog, SubjectStats, SubjectTable
from qmq_wire.ordered import partition_log, split_partition_log


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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StatsService:
    """What the stats routes answer, read from the live tables on the event loop."""

    lifecycle: Lifecycle
    subject_table: SubjectTable
    groups: GroupTable
    delayed: DelayedMessages
    book: RouteBook

    def subjects(self) -> list[SubjectStats]:
        self.lifecycle.require(write=False)
        listed: dict[str, SubjectStats] = {}
        for name in sorted(self.subject_table):
            subject, partition = split_partition_log(name)
            stats = self._without_command(self.subject_table[name], subject, partition)
            if partition is None:
                listed[name] = stats
            elif subject in listed:
                listed[subject] = _summed(listed[subject], stats, _SUBJECT_COUNTERS)
            else:
                listed[subject] = dataclasses.replace(stats, subject=subject, first_seq=0)
        for subject in self.book.subjects():  # declared, nothing stored or pulled yet
            listed.setdefault(
                subject, SubjectStats(subject=subject, messages=0, bytes=0, first_seq=0, next_seq=0)
            )
        return [listed[name] for name in sorted(listed)]

    def subject(self, name: str) -> SubjectDetail:
        self.lifecycle.require(write=False)
        partitions = self.book.partitions(name)  # a fenced subject's too: reads serve it
        if partitions is not None:
            return self._ordered_subject(name, partitions)
        log = self.subject_table.get(name)
        if log is None and self.delayed.knows(name):
            log = SubjectLog(name, self.subject_table.reader, None)  # only delayed messages so far
        if log is None:
            raise NotFound(
                code="subject_not_found", message=f"no subject {name!r}", field="subject"
            )
        groups = [group.stats(log.end_seq) for group in self.groups.of_subject(name)]
        return self._detail(log.stats(), groups)

    def _ordered_subject(self, name: str, partitions: list[int]) -> SubjectDetail:
        """An ordered subject: its partitions' counters summed, each group's too."""
        total = SubjectStats(subject=name, messages=0, bytes=0, first_seq=0, next_seq=0)
        groups: dict[str, GroupStats] = {}
        for partition in partitions:
            log = self.subject_table.get(partition_log(name, partition))
            if log is None:
                continue
            total = _summed(total, self._without_command(log, name, partition), _SUBJECT_COUNTERS)
            for group in self.groups.of_subject(log.name):
                stats = dataclasses.replace(group.stats(log.end_seq), mode="ordered")
                found = groups.get(group.name)
                if found is not None:
                    stats = _summed(found, stats, _GROUP_COUNTERS)
                groups[group.name] = stats
        return self._detail(total, [groups[group] for group in sorted(groups)])

    def _detail(self, stats: SubjectStats, groups: list[GroupStats]) -> SubjectDetail:
        """A subject's counters with its delayed messages and ``groups``."""
        return SubjectDetail(
            subject=stats.subject,
            messages=stats.messages,
            bytes=stats.bytes,
            first_seq=stats.first_seq,
            next_seq=stats.next_seq,
            scheduled=self.delayed.subject_stats(stats.subject),
            groups=groups,
        )

    def _without_command(
        self, log: SubjectLog, subject: str, partition: int | None
    ) -> SubjectStats:
        """A log's counters; a closed partition's command message is not counted."""
        stats = log.stats()
        command = None if partition is None else self.book.command_seq(subject, partition)
        if command is not None and log.first_seq <= command < log.end_seq:
            stats = dataclasses.replace(stats, messages=stats.messages - 1)
        return stats

    def schedule(self, *, limit: int) -> ScheduleStats:
        """Pending delayed messages by hour, next due time, dispatch lag."""
        self.lifecycle.require(write=False)
        return self.delayed.stats(limit=limit)

    def oldest_unacked(self, name: str) -> dict[str, int]:
        """Each group's oldest message not acked yet (waiting, leased or retrying; dead
        letters are done with): its stored time in microseconds. Groups with none are left
        out; an ordered subject's partitions count together."""
        self.lifecycle.require(write=False)
        partitions = self.book.partitions(name)
        logs: list[tuple[str, int | None]] = (
            [(partition_log(name, p), self.book.command_seq(name, p)) for p in partitions]
            if partitions is not None
            else [(name, None)]
        )
        oldest: dict[str, int] = {}
        for log_name, command in logs:
            log = self.subject_table.get(log_name)
            if log is None:
                continue
            for group in self.groups.of_subject(log_name):
                stored_us = _oldest_stored_us(log, group.states.values(), command)
                if stored_us is not None:
                    found = oldest.get(group.name)
                    oldest[group.name] = stored_us if found is None else min(found, stored_us)
        return oldest

    def group_backlogs(self) -> Iterator[tuple[str, str, GroupStats]]:
        """Every group's counters, for the metrics."""
        for (subject, name), group in self.groups.items():
            log = self.subject_table.get(subject)
            if log is not None:
                yield subject, name, group.stats(log.end_seq)


def _oldest_stored_us(
    log: SubjectLog, states: Iterable[DeliveryState], command: int | None
) -> int | None:
    """The stored time of the lowest seq the states have not acked, if it is still kept (a
    closed partition's command message is not a message)."""
    seqs: list[int] = []
    for state in states:
        waiting = max(state.cursor, log.first_seq)  # below first_seq: removed by retention
        if waiting < log.end_seq and waiting != command:
            seqs.append(waiting)
        if state.leases:
            seqs.append(min(state.leases))
        if state.retries:
            seqs.append(min(state.retries))
    kept = [seq for seq in seqs if log.first_seq <= seq < log.end_seq]
    return log.raw(min(kept))[3] if kept else None


Stats = TypeVar("Stats", SubjectStats, GroupStats)
_SUBJECT_COUNTERS = ("messages", "bytes", "next_seq")
"""An ordered subject's counters summed over its partitions: messages, bytes and seqs
ever stored."""
_GROUP_COUNTERS = ("backlog", "in_flight", "retrying", "dead", "acked", "filtered")


def _summed(total: Stats, more: Stats, counters: tuple[str, ...]) -> Stats:
    """``total`` with each of its ``counters`` plus the same one of ``more``."""
    added = {name: getattr(total, name) + getattr(more, name) for name in counters}
    return dataclasses.replace(total, **added)
