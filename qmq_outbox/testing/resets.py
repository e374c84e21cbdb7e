"""``POST /v1/subjects/{subject}/groups/{group}/reset`` in memory, by the broker's rules.

Every state owner of the group moves (each consumer of a broadcast group, each partition of
an ordered subject, or the one named); refused with ``group_busy`` while any of them has
messages leased out, unless ``force``.
"""

from __future__ import annotations

from typing import Any

import qmq_wire as wire
from qmq_outbox.testing.delivery import DeliveryState
from qmq_outbox.testing.ordered import partition_logs
from qmq_outbox.testing.ordered_pulls import OrderedPulls
from qmq_outbox.testing.state import BrokerState
from qmq_wire import rules
from qmq_wire.ordered import partition_log
from qmq_wire.rules import Position, Refused

Moved = tuple[int | None, str | None, str, DeliveryState]  # partition, consumer, log, owner


class Resets:
    def __init__(self, state: BrokerState, ordered: OrderedPulls) -> None:
        self.state = state
        self.ordered = ordered

    def reset_group(self, doc: Any, subject: str, name: str) -> dict[str, Any]:
        rules.check_name(subject, "subject")
        rules.check_name(name, "group")
        checked = rules.RESET.with_defaults(rules.RESET.check(doc))
        to = Position.of(checked["to"])
        assert to is not None  # checked
        partition = checked["partition"]
        group = None  # a plain subject's group, whose tag filter a reset frees
        if subject in self.state.ordered:
            moved = self._ordered(subject, name, to, partition)
        else:
            _, group = self.state.group(subject, name, partition)
            moved = [
                (None, key or None, subject, owner) for key, owner in sorted(group.owners.items())
            ]
        leased = sum(len(owner.leases) for *_, owner in moved)
        if leased and not checked["force"]:
            message = (
                f"group {name!r} on {subject!r} has {leased} messages leased out: wait for "
                'their acks, or reset with "force": true'
            )
            raise Refused("group_busy", message, "force")
        if group is not None:
            group.tags = None  # the next pull fixes it again
        positions: list[wire.ResetPositionJson] = []
        for number, consumer, log, owner in moved:
            owner.reset(self.state.log(log).seq_at(to))
            positions.append({"partition": number, "consumer": consumer, "seq": owner.cursor})
        self.state.wake()
        answer: wire.ResetAnswerJson = {"positions": positions, "dropped_leases": leased}
        return dict(answer)

    def _ordered(self, subject: str, name: str, to: Position, partition: int | None) -> list[Moved]:
        routes = self.state.ordered[subject]
        numbers = [number for number, _ in partition_logs(routes)]
        if partition is not None and partition not in numbers:
            message = f"{subject!r} has no partition {partition}"
            raise Refused("partition_not_found", message, "partition")
        if to.kind == "seq" and partition is None:
            message = f"{subject!r} is ordered: its seqs count per partition, name one"
            raise Refused("partition_required", message, "partition")
        if (partition_logs(routes)[0][1], name) not in self.state.groups:
            raise Refused("group_not_found", f"no group {name!r} on {subject!r}", "group")
        chosen = numbers if partition is None else [partition]
        return [
            (number, None, log, self.ordered.owner(log, name))
            for number in chosen
            for log in [partition_log(subject, number)]
        ]
