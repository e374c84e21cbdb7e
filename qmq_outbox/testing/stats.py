"""``GET /v1/subjects`` and ``GET /v1/subjects/{subject}`` in memory: counters per subject
and group; an ordered subject's are its partitions' summed (seqs count per partition)."""

from __future__ import annotations

from typing import Any

import qmq_wire as wire
from qmq_outbox.testing.logs import SubjectLog
from qmq_outbox.testing.ordered import partition_logs
from qmq_outbox.testing.state import BrokerState
from qmq_wire import rules
from qmq_wire.ordered import split_partition_log
from qmq_wire.routes import Routes
from qmq_wire.rules import Refused

_GROUP_COUNTERS = ("backlog", "in_flight", "retrying", "dead", "acked", "filtered")


class Stats:
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    def subjects(self, params: dict[str, str]) -> dict[str, Any]:
        """Every subject; an ordered one with its partitions' counters summed."""
        listed: dict[str, wire.SubjectStatsJson] = {}
        for name in sorted(self.state.logs):
            subject, partition = split_partition_log(name)
            stats = self.state.logs[name].stats()
            if partition is None:
                listed[name] = stats
            elif subject in listed:
                listed[subject] = _summed(listed[subject], stats)
            else:
                listed[subject] = {**stats, "subject": subject, "first_seq": 0}
        for subject in self.state.ordered:  # declared, nothing stored or pulled yet
            listed.setdefault(subject, SubjectLog(subject).stats())
        return {"subjects": [listed[name] for name in sorted(listed)]}

    def subject(self, params: dict[str, str], name: str) -> dict[str, Any]:
        rules.check_name(name, "subject")
        routes = self.state.ordered.get(name)
        if routes is not None:
            return self._ordered_subject(routes)
        delayed = self.state.delayed.of(name)
        log = self.state.logs.get(name)
        if log is None and not delayed:
            raise Refused("subject_not_found", f"no subject {name!r}", "subject")
        log = log or SubjectLog(name)
        groups = sorted((g.name, g) for (s, _), g in self.state.groups.items() if s == name)
        return {
            **log.stats(),
            "scheduled": {
                "messages": len(delayed),
                "bytes": sum(len(d.body) for d in delayed),
                "unreadable": 0,
            },
            "groups": [group.stats(log.end) for _, group in groups],
        }

    def _ordered_subject(self, routes: Routes) -> dict[str, Any]:
        """An ordered subject's counters and each group's, its partitions' summed."""
        total = SubjectLog(routes.subject).stats()
        groups: dict[str, dict[str, Any]] = {}
        for _, name in partition_logs(routes):
            log = self.state.logs.get(name)
            if log is None:
                continue
            total = _summed(total, log.stats())
            for (where, group_name), group in self.state.groups.items():
                if where != name:
                    continue
                stats = group.stats(log.end)
                found = groups.get(group_name)
                groups[group_name] = stats if found is None else _group_summed(found, stats)
        return {
            **total,
            "scheduled": {"messages": 0, "bytes": 0, "unreadable": 0},
            "groups": [groups[name] for name in sorted(groups)],
        }


def _summed(total: wire.SubjectStatsJson, more: wire.SubjectStatsJson) -> wire.SubjectStatsJson:
    return {
        **total,
        "messages": total["messages"] + more["messages"],
        "bytes": total["bytes"] + more["bytes"],
        "next_seq": total["next_seq"] + more["next_seq"],
    }


def _group_summed(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    return {**total, **{name: int(total[name]) + int(more[name]) for name in _GROUP_COUNTERS}}
