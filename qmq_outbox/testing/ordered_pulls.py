"""Ordered pulls in memory: each partition in seq order, its keys side by side up to the
pull's ``max_keys`` (``qmq_wire.keyed``, as the broker); with 1, one batch at a time.

A group joins every partition at its first pull and consumes the partitions of the route
version it has reached; it reaches the next once it finished every partition the change
closed (everything handled; dead letters too unless the subject blocks on them).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import qmq_wire as wire
from qmq_outbox.testing.delivery import DeliveryState, GroupState
from qmq_outbox.testing.longpoll import LongPoll
from qmq_outbox.testing.ordered import open_partition_logs, partition_logs
from qmq_outbox.testing.state import BrokerState
from qmq_wire import rules
from qmq_wire.ordered import partition_log
from qmq_wire.routes import Routes
from qmq_wire.rules import Position, Refused


class OrderedPulls:
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    def start(self, pull: dict[str, Any]) -> LongPoll:
        """A checked ordered pull, refused on a plain subject or with acks."""
        subject, name = pull["subject"], pull["group"]
        routes = self.state.ordered.get(subject)
        if routes is None:
            message = f"{subject!r} is not ordered: pull it in shared or broadcast mode"
            raise Refused("not_ordered", message, "mode")
        if pull["mode"] != "ordered":
            message = f"{subject!r} is ordered: pull it in ordered mode"
            raise Refused("mode_conflict", message, "mode")
        if pull["ack"] is not None:
            message = f"{subject!r} is ordered: ack with POST /v1/ack naming the partition"
            raise Refused("partition_required", message, "ack")
        start = rules.Position.of(pull["start"])
        assert start is not None  # checked
        joined = (partition_logs(routes)[0][1], name) in self.state.groups
        if not joined:  # joins: every partition now
            if start.kind == "seq":
                message = (
                    f"{subject!r} is ordered: its seqs count per partition, so a group "
                    "starts at a time (or resets one partition to a seq)"
                )
                raise Refused("partition_required", message, "start")
            for _, log in partition_logs(routes):
                self.owner(log, name, at=start)
        deadline = time.monotonic() + pull["wait_ms"] / 1000
        poll = LongPoll(subject, name, "", pull["consumer"], pull["max"], deadline, {})
        return dataclasses.replace(poll, max_keys=pull["max_keys"])

    def lease(self, poll: LongPoll, routes: Routes, now: int) -> list[wire.PulledMessageJson]:
        """The next batch of each partition that has nothing in flight, up to the limit."""
        policy = self.state.policy
        served: list[wire.PulledMessageJson] = []
        for _, log in partition_logs(routes):
            self.owner(log, poll.group).expire(now_us=now, policy=policy)
        for _, name in open_partition_logs(routes, lambda p: self.finished(routes, p, poll.group)):
            if len(served) >= poll.limit:
                break
            stored = self.state.logs[name]
            chosen = self.owner(name, poll.group).lease_in_order(
                consumer=poll.consumer,
                limit=poll.limit - len(served),
                end_seq=stored.end,
                now_us=now,
                policy=policy,
                hold_on_dead=routes.on_dead == "block",
                max_keys=poll.max_keys,
                key_of=stored.key_of,
            )
            served.extend(stored.messages[seq].to_json(attempt) for seq, attempt in chosen)
        return served

    def owner(self, log: str, group: str, *, at: Position | None = None) -> DeliveryState:
        """A group's state on an ordered subject's partition, made at its start (or at
        ``at``) when first needed: a partition a split made later starts empty."""
        state = self.state.groups.get((log, group))
        if state is None:
            state = self.state.groups[(log, group)] = GroupState(group, "ordered")
        owner = state.owners.get("")
        if owner is None:
            stored = self.state.log(log)  # made with the state, as the broker makes the log
            owner = state.owners[""] = DeliveryState(0 if at is None else stored.seq_at(at))
        return owner

    def finished(self, routes: Routes, partition: int, group: str) -> bool:
        """Whether ``group`` is done with closed ``partition``: everything in it handled
        (dead letters too, unless the subject blocks on them). Closed partitions take no
        more messages, so the broker's command message would come next."""
        if partition not in routes.closed():
            return False
        log = partition_log(routes.subject, partition)
        owner = self.owner(log, group)
        return (
            owner.cursor >= self.state.log(log).end
            and not owner.leases
            and not owner.retries
            and not owner.skipped
            and (routes.on_dead == "skip" or not owner.dead)
        )

    def group_version(self, routes: Routes, group: str) -> int:
        """The route version whose partitions ``group`` consumes."""
        return routes.group_version(lambda p: self.finished(routes, p, group))
