"""Declaring ordered subjects and changing their routes in memory, by the broker's own route
rules (``qmq_wire.routes``): split, merge and move make the next version, 409 when they
break a rule; each answer is the subject's routes with every group's version."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import qmq_wire as wire
from qmq_outbox.testing.ordered import partition_logs
from qmq_outbox.testing.ordered_pulls import OrderedPulls
from qmq_outbox.testing.state import BrokerState
from qmq_wire import rules
from qmq_wire.routes import RouteConflict, Routes
from qmq_wire.rules import Refused


class RouteChanges:
    def __init__(self, state: BrokerState, pulls: OrderedPulls) -> None:
        self.state = state
        self.pulls = pulls

    def declare_subject(self, doc: Any, subject: str) -> dict[str, Any]:
        rules.check_name(subject, "subject")
        declared = rules.DECLARE.with_defaults(rules.DECLARE.check(doc))
        partitions, on_dead = declared["partitions"], declared["on_dead"]
        found = self.state.ordered.get(subject)
        if found is not None:
            declared_with = len(found.at(1).partitions)
            if (declared_with, found.on_dead) != (partitions, on_dead):
                message = (
                    f"{subject!r} is ordered with {declared_with} partitions "
                    f"and on_dead {found.on_dead!r}"
                )
                raise Refused("subject_conflict", message, "partitions")
            return self._document(found)
        if subject in self.state.logs or self.state.delayed.holds(subject):
            message = f"{subject!r} already holds or served messages unordered"
            raise Refused("subject_conflict", message, "subject")
        made = Routes.create(subject, partitions=partitions, on_dead=on_dead)
        self.state.ordered[subject] = made
        return self._document(made)

    def routes(self, params: dict[str, str], subject: str) -> dict[str, Any]:
        return self._document(self._declared(subject))

    def split_partition(self, doc: Any, subject: str) -> dict[str, Any]:
        split = rules.SPLIT.check(doc)
        return self._change(subject, lambda routes: routes.split(split["partition"], split["at"]))

    def merge_partitions(self, doc: Any, subject: str) -> dict[str, Any]:
        partitions: list[int] = rules.MERGE.check(doc)["partitions"]
        return self._change(subject, lambda routes: routes.merge(partitions))

    def move_partition(self, doc: Any, subject: str) -> dict[str, Any]:
        partition: int = rules.MOVE.check(doc)["partition"]
        return self._change(subject, lambda routes: routes.move(partition))

    def _change(self, subject: str, change: Callable[[Routes], Routes]) -> dict[str, Any]:
        """A route change: the next version, refused (409) when it breaks a rule."""
        try:
            changed = change(self._declared(subject))
        except RouteConflict as exc:
            raise Refused("route_conflict", exc.message, exc.field) from None
        self.state.ordered[subject] = changed
        self.state.wake()  # a group may move on at once (nothing was left in the closed one)
        return self._document(changed)

    def _declared(self, subject: str) -> Routes:
        """An ordered subject (404 for an unknown one, 409 for a plain one)."""
        rules.check_name(subject, "subject")
        routes = self.state.ordered.get(subject)
        if routes is not None:
            return routes
        if subject in self.state.logs:
            raise Refused("not_ordered", f"{subject!r} is not ordered", "subject")
        raise Refused("subject_not_found", f"no subject {subject!r}", "subject")

    def _document(self, routes: Routes) -> dict[str, Any]:
        logs = {log for _, log in partition_logs(routes)}
        groups = sorted({name for log, name in self.state.groups if log in logs})
        versions = {group: self.pulls.group_version(routes, group) for group in groups}
        document: wire.RoutesAnswerJson = routes.document(versions)
        return dict(document)
