"""``POST /v1/pull``, ``/v1/ack`` and ``/v1/nack`` in memory, for plain and ordered subjects.

A shared group has one state owner, a broadcast group one per consumer; a pull may carry
acks. Ordered subjects' pulls are ``OrderedPulls``'s. The peak of leases each consumer held
is kept for ``InMemoryBroker.most_leased``.
"""

from __future__ import annotations

import time
from typing import Any

import qmq_wire as wire
from qmq_outbox.testing.delivery import DeliveryState, GroupState
from qmq_outbox.testing.longpoll import LongPoll
from qmq_outbox.testing.ordered import partition_logs
from qmq_outbox.testing.ordered_pulls import OrderedPulls
from qmq_outbox.testing.state import BrokerState
from qmq_wire import rules
from qmq_wire.rules import Refused


class Pulls:
    def __init__(self, state: BrokerState) -> None:
        self.state = state
        self.ordered = OrderedPulls(state)
        self.most_leased: dict[tuple[str, str], int] = {}  # by (group, consumer)

    def pull(self, doc: Any) -> dict[str, Any] | LongPoll:
        pull = rules.PULL.with_defaults(rules.PULL.check(doc))
        pull["min"] = min(pull["min"], pull["max"])  # a larger min asks for a full batch
        subject, name, consumer, mode = (pull[f] for f in ("subject", "group", "consumer", "mode"))
        if mode == "ordered" or subject in self.state.ordered:
            if pull["tags"]:
                message = "tag filters are for shared and broadcast groups, not ordered ones"
                raise Refused("tags_not_ordered", message, "tags")
            poll = self.ordered.start(pull)
            acks: dict[str, Any] = {}
        else:
            group = self.state.groups.get((subject, name))
            if group is not None and group.mode != mode:
                message = f"group {name!r} on {subject!r} is in {group.mode} mode"
                raise Refused("mode_conflict", message, "mode")
            wanted = tuple(sorted(pull["tags"] or ()))
            if group is not None and group.tags is not None and group.tags != wanted:
                shown = list(group.tags) or "no filter"
                message = f"group {name!r} on {subject!r} filters tags {shown}: reset it first"
                raise Refused("tags_conflict", message, "tags")
            if group is None:
                group = self.state.groups[(subject, name)] = GroupState(name, mode, tags=wanted)
            elif group.tags is None:  # a reset cleared it: this pull fixes it again
                group.tags = wanted
            owner = group.owner_key(consumer)
            if owner not in group.owners:
                start = rules.Position.of(pull["start"])
                assert start is not None  # checked
                group.owners[owner] = DeliveryState(self.state.log(subject).seq_at(start))
            acks = {} if pull["ack"] is None else self.apply_acks({**pull, "seqs": pull["ack"]})
            now = time.monotonic()
            poll = LongPoll(
                subject,
                name,
                owner,
                consumer,
                pull["max"],
                now + pull["wait_ms"] / 1000,
                acks,
                pull["min"],
                now + min(pull["linger_ms"], pull["wait_ms"]) / 1000,
            )
        messages = self.lease(poll)
        if messages or pull["wait_ms"] == 0:
            return {"messages": messages, **acks}
        return poll

    def lease(self, poll: LongPoll) -> list[wire.PulledMessageJson]:
        """What the poll is served now (nothing while it lingers for ``min_messages``)."""
        routes = self.state.ordered.get(poll.subject)
        if routes is None:
            self.state.release_due()
        now = self.state.now_us()
        if routes is not None:
            served = self.ordered.lease(poll, routes, now)
        else:
            served = self._lease_plain(poll, now)
        if served:
            self._note_leased(poll.group, poll.consumer, now)
        return served

    def _lease_plain(self, poll: LongPoll, now: int) -> list[wire.PulledMessageJson]:
        policy = self.state.policy
        group = self.state.groups[(poll.subject, poll.group)]
        owner = group.owners[poll.owner]
        owner.expire(now_us=now, policy=policy)
        log = self.state.logs[poll.subject]
        matches = None
        if group.tags:
            wanted = group.tags
            matches = lambda seq: rules.tags_match(log.messages[seq].tags, wanted)  # noqa: E731
        lingering = poll.min_messages > 1 and time.monotonic() < poll.linger_until
        ready = owner.ready(end_seq=log.end, now_us=now, matches=matches)
        if lingering and ready < poll.min_messages:
            return []  # waits for a fuller batch until linger_until
        chosen = owner.lease(
            consumer=poll.consumer,
            limit=poll.limit,
            end_seq=log.end,
            now_us=now,
            policy=policy,
            matches=matches,
        )
        return [log.messages[seq].to_json(attempt) for seq, attempt in chosen]

    def next_due_us(self, poll: LongPoll) -> int | None:
        """When a lease of the poll's group expires, or a retry or delayed message comes due."""
        routes = self.state.ordered.get(poll.subject)
        if routes is None:
            owners = [self.state.groups[(poll.subject, poll.group)].owners[poll.owner]]
        else:
            owners = [self.ordered.owner(log, poll.group) for _, log in partition_logs(routes)]
        times = [owner.next_due_us() for owner in owners] + [self.state.delayed.next_due_us()]
        return min((t for t in times if t), default=None)

    def _note_leased(self, group: str, consumer: str, now_us: int) -> None:
        """Keep the peak of the live leases ``consumer`` holds in ``group``, all subjects."""
        held = sum(
            1
            for (_, name), state in self.state.groups.items()
            if name == group
            for owner in state.owners.values()
            for lease in owner.leases.values()
            if lease.consumer == consumer and lease.deadline_us > now_us
        )
        key = (group, consumer)
        self.most_leased[key] = max(self.most_leased.get(key, 0), held)

    def ack(self, doc: Any) -> dict[str, Any]:
        answer = self.apply_acks(rules.ACK.check(doc))
        if answer["acked"] and doc["subject"] in self.state.ordered:
            self.state.wake()  # the partition's next batch may be served now
        return answer

    def apply_acks(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Ack a checked ``{subject, group, consumer, seqs}`` (an ack, or a pull's acks)."""
        owner = self.state.owner(doc)
        unique = list(dict.fromkeys(doc["seqs"]))
        known = [seq for seq in unique if owner.holds(seq, doc["consumer"])]
        owner.ack(known)
        return {"acked": len(known), "unknown": [seq for seq in unique if seq not in known]}

    def nack(self, doc: Any) -> dict[str, Any]:
        owner = self.state.owner(rules.NACK.check(doc))
        delay_ms = doc.get("delay_ms")
        log = self.state.log_of(doc["subject"], doc.get("partition"))
        retrying, dead = owner.nack(
            list(dict.fromkeys(doc["seqs"])),
            key_of=self.state.logs[log].key_of if doc["subject"] in self.state.ordered else None,
            consumer=doc["consumer"],
            now_us=self.state.now_us(),
            delay_us=delay_ms * 1000 if delay_ms is not None else None,
            error=doc.get("error"),
            policy=self.state.policy,
        )
        if retrying or dead:
            self.state.wake()
        return {"retrying": retrying, "dead": dead}
