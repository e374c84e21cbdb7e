"""Consumer-group delivery state: cursor, leases, retries and dead letters (pure logic).

Every change is expressed as an ``ActionRecord`` first and then applied, both live and on
replay from the action log, so a restart rebuilds exactly the state the broker had. The
clock is passed in; nothing here does I/O.

``DeliveryState`` belongs to a whole group in shared mode, and to one consumer of the group
in broadcast mode. Messages below the cursor that are not leased, retrying, dead or skipped
are done: acked, or passed by the group's tag filter. ``skipped``: seqs below the cursor
never leased, the gaps a LEASE of later seqs leaves (an ordered partition serves past the
messages of keys that have one in flight); shared and broadcast pulls lease from the cursor
on, so their states never have any. A filter's skips ride on the LEASE record of the pull
that made them (``skip_to``: the cursor moves there, ``filtered``: how many), so they need
no record of their own and replay counts them once.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec

from qmq_broker.format.actions import ActionRecord, ActionType
from qmq_wire.delivery import RetryPolicy

SHARED_STATE = ""


class Lease(msgspec.Struct, frozen=True, gc=False):
    """A message's lease: one is built per message a pull serves, and a msgspec struct costs
    a sixth of a slotted dataclass to build. Strings and ints only: no cycle to collect."""

    consumer: str
    attempt: int
    deadline_us: int


@dataclasses.dataclass(slots=True)
class RetryDue:
    attempts: int  # attempts made so far
    due_us: int
    error: str | None


@dataclasses.dataclass(slots=True)
class DeadLetter:
    attempts: int
    error: str | None
    at_us: int


Policy = RetryPolicy  # the pulls import it by this name


class DeliveryState:
    """Where one state owner (a shared group, or a broadcast consumer) stands in a subject."""

    __slots__ = (
        "acked",
        "cursor",
        "dead",
        "filtered",
        "lease_heap",
        "leases",
        "retries",
        "retry_heap",
        "skipped",
    )

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor
        self.leases: dict[int, Lease] = {}
        self.retries: dict[int, RetryDue] = {}
        self.dead: dict[int, DeadLetter] = {}
        self.acked = 0
        self.filtered = 0  # messages the group's tag filter skipped
        self.lease_heap: list[tuple[int, int]] = []  # (deadline, seq), stale entries skipped
        self.retry_heap: list[tuple[int, int]] = []  # (due, seq), stale entries skipped
        self.skipped: set[int] = set()  # below the cursor, never leased (see the module doc)

    # --- decisions (return records; nothing changes until they are applied) --------------

    def expire(
        self, *, now_us: int, policy: RetryPolicy
    ) -> list[tuple[ActionType, list[int], dict[str, Any]]]:
        """Leases past their deadline count as failed attempts: retry now, or dead."""
        retry: list[int] = []
        dead: list[int] = []
        heap = self.lease_heap
        while heap and heap[0][0] <= now_us:
            deadline, seq = heapq.heappop(heap)
            lease = self.leases.get(seq)
            if lease is None or lease.deadline_us != deadline:
                continue
            (dead if lease.attempt >= policy.max_attempts else retry).append(seq)
        out: list[tuple[ActionType, list[int], dict[str, Any]]] = []
        if retry:
            out.append((ActionType.RETRY, retry, {"due": now_us, "error": "lease expired"}))
        if dead:
            out.append((ActionType.DEAD, dead, {"error": "lease expired"}))
        return out

    def choose(self, *, limit: int, now_us: int, end_seq: int) -> tuple[list[int], list[int]]:
        """Seqs to lease now with their attempt numbers: due retries first, then new ones."""
        seqs: list[int] = []
        attempts: list[int] = []
        heap = self.retry_heap
        skipped: list[tuple[int, int]] = []
        while heap and len(seqs) < limit and heap[0][0] <= now_us:
            due, seq = heapq.heappop(heap)
            retry = self.retries.get(seq)
            if retry is None or retry.due_us != due:
                continue
            if seq in seqs:
                skipped.append((due, seq))
                continue
            seqs.append(seq)
            attempts.append(retry.attempts + 1)
        for item in skipped:
            heapq.heappush(heap, item)
        # Popped entries stay valid until the LEASE is applied; push them back so that an
        # unapplied choice (e.g. the read failed) loses nothing.
        for seq in seqs:
            retry = self.retries[seq]
            heapq.heappush(heap, (retry.due_us, seq))
        new = range(self.cursor, max(self.cursor, min(end_seq, self.cursor + limit - len(seqs))))
        seqs += new
        attempts += [1] * len(new)
        return seqs, attempts

    def nack_outcomes(
        self,
        seqs: Iterable[int],
        *,
        consumer: str,
        now_us: int,
        delay_us: int | None,
        policy: RetryPolicy,
    ) -> tuple[dict[int, list[int]], list[int]]:
        """Group the seqs ``consumer`` holds by retry due time; seqs out of attempts go dead."""
        retry: dict[int, list[int]] = {}
        dead: list[int] = []
        for seq in seqs:
            lease = self.leases.get(seq)
            if lease is None or lease.consumer != consumer:
                continue
            if lease.attempt >= policy.max_attempts:
                dead.append(seq)
                continue
            wait = delay_us if delay_us is not None else policy.backoff_us(lease.attempt)
            retry.setdefault(now_us + wait, []).append(seq)
        return retry, dead

    def holds(self, seq: int, consumer: str) -> bool:
        """Whether ``consumer`` holds the lease of ``seq``: only the holder may ack or nack."""
        lease = self.leases.get(seq)
        return lease is not None and lease.consumer == consumer

    def skip_below(self, first_seq: int) -> None:
        """Retention removed what this state never read: move the cursor past it.

        Not an action record: replay reaches the same cursor at the next pull.
        """
        if self.cursor < first_seq:
            self.cursor = first_seq
        if self.skipped and min(self.skipped) < first_seq:
            self.skipped = {seq for seq in self.skipped if seq >= first_seq}

    def next_wakeup_us(self) -> int | None:
        """When a lease expires or a retry comes due next (stale heap tops make it early)."""
        times = [h[0][0] for h in (self.lease_heap, self.retry_heap) if h]
        return min(times) if times else None

    # --- applying records -------------------------------------------------------------------

    def apply(self, record: ActionRecord) -> None:
        kind = record.type
        if kind is ActionType.LEASE:
            self._apply_lease(record)
        elif kind is ActionType.ACK:
            for seq in record.seqs:
                leased = self.leases.pop(seq, None) is not None
                if self.retries.pop(seq, None) is not None or leased:
                    self.acked += 1
        elif kind is ActionType.RETRY:
            due = int(record.fields["due"])
            error = record.fields.get("error")
            # "released": given back unrun (behind a failure of their key): no attempt made
            made = 0 if record.fields.get("released") else 1
            for seq in record.seqs:
                lease = self.leases.pop(seq, None)
                previous = self.retries.get(seq)
                attempts = (
                    lease.attempt - 1 + made if lease else (previous.attempts if previous else 0)
                )
                self.retries[seq] = RetryDue(attempts=attempts, due_us=due, error=error)
                heapq.heappush(self.retry_heap, (due, seq))
        elif kind is ActionType.DEAD:
            error = record.fields.get("error")
            for seq in record.seqs:
                lease = self.leases.pop(seq, None)
                retry = self.retries.pop(seq, None)
                attempts = lease.attempt if lease else (retry.attempts if retry else 0)
                self.dead[seq] = DeadLetter(attempts=attempts, error=error, at_us=record.at_us)
        elif kind is ActionType.RESET:
            self._apply_reset(int(record.fields["cursor"]))
        elif kind is ActionType.REDRIVE:
            for seq in record.seqs:
                if self.dead.pop(seq, None) is not None:
                    self.retries[seq] = RetryDue(attempts=0, due_us=record.at_us, error=None)
                    heapq.heappush(self.retry_heap, (record.at_us, seq))

    def _apply_reset(self, cursor: int) -> None:
        """Read from ``cursor`` next: every lease is dropped (a late ack of one is
        ``unknown``), and retries, dead letters and passed-over seqs at or after ``cursor``
        go, since their messages are delivered afresh from there; those before it stay as
        they were."""
        self.cursor = cursor
        self.leases.clear()
        self.lease_heap.clear()
        self.retries = {s: r for s, r in self.retries.items() if s < cursor}
        self.dead = {s: d for s, d in self.dead.items() if s < cursor}
        self.skipped = {s for s in self.skipped if s < cursor}
        self.retry_heap = [(r.due_us, s) for s, r in self.retries.items()]
        heapq.heapify(self.retry_heap)

    def _apply_lease(self, record: ActionRecord) -> None:
        consumer = str(record.fields["consumer"])
        deadline = int(record.fields["deadline"])
        attempts = record.fields["attempts"]
        # a filtered pull's gaps are done (filtered, or dead if unreadable); an ordered one's
        # are passed over (the tag filters are not for ordered subjects)
        filtering = "filtered" in record.fields or "skip_to" in record.fields
        shared: dict[int, Lease] = {}  # one lease per attempt number: they are immutable
        leases, retries, skipped, heap = self.leases, self.retries, self.skipped, self.lease_heap
        cursor = self.cursor
        for seq, attempt in zip(record.seqs, attempts, strict=True):
            if retries:
                retries.pop(seq, None)
            if skipped:
                skipped.discard(seq)
            lease = shared.get(attempt)
            if lease is None:
                lease = shared[attempt] = Lease(
                    consumer=consumer, attempt=int(attempt), deadline_us=deadline
                )
            leases[seq] = lease
            heapq.heappush(heap, (deadline, seq))
            if seq >= cursor:
                if seq > cursor and not filtering:
                    skipped.update(s for s in range(cursor, seq) if s not in self.dead)
                cursor = seq + 1
        self.cursor = cursor
        # A tag filter's skips (absent from records without a filter, and older ones)
        skip_to = record.fields.get("skip_to")
        if skip_to is not None and int(skip_to) > self.cursor:
            self.cursor = int(skip_to)
        self.filtered += int(record.fields.get("filtered", 0))

    # --- snapshots ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "acked": self.acked,
            "filtered": self.filtered,
            "leases": [[s, x.consumer, x.attempt, x.deadline_us] for s, x in self.leases.items()],
            "retries": [[s, r.attempts, r.due_us, r.error] for s, r in self.retries.items()],
            "dead": [[s, d.attempts, d.error, d.at_us] for s, d in self.dead.items()],
            **({"skipped": sorted(self.skipped)} if self.skipped else {}),
        }

    @classmethod
    def restore(cls, doc: dict[str, Any]) -> DeliveryState:
        state = cls(int(doc["cursor"]))
        state.acked = int(doc["acked"])
        state.filtered = int(doc.get("filtered", 0))  # absent from older checkpoints
        for seq, consumer, attempt, deadline in doc["leases"]:
            state.leases[seq] = Lease(consumer=consumer, attempt=attempt, deadline_us=deadline)
            state.lease_heap.append((deadline, seq))
        for seq, attempts, due, error in doc["retries"]:
            state.retries[seq] = RetryDue(attempts=attempts, due_us=due, error=error)
            state.retry_heap.append((due, seq))
        for seq, attempts, error, at in doc["dead"]:
            state.dead[seq] = DeadLetter(attempts=attempts, error=error, at_us=at)
        state.skipped = {int(seq) for seq in doc.get("skipped", ())}  # absent before issue 39
        heapq.heapify(state.lease_heap)
        heapq.heapify(state.retry_heap)
        return state


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GroupStats:
    group: str
    mode: str
    backlog: int
    in_flight: int
    retrying: int
    dead: int
    acked: int
    filtered: int
    tags: list[str]


@dataclasses.dataclass(slots=True)
class Group:
    """A consumer group on one subject: its mode, tag filter and delivery state(s).

    ``tags``: the filter its first pull fixed (any of them; empty: every message), or None
    when nothing has fixed one yet (a reset clears it so the next pull fixes it again).
    """

    subject: str
    name: str
    mode: str  # "shared" | "broadcast"
    states: dict[str, DeliveryState] = dataclasses.field(default_factory=dict)
    tags: tuple[str, ...] | None = ()

    def state_key(self, consumer: str) -> str:
        return consumer if self.mode == "broadcast" else SHARED_STATE

    def stats(self, end_seq: int) -> GroupStats:
        states = list(self.states.values())
        return GroupStats(
            group=self.name,
            mode=self.mode,
            backlog=sum(max(end_seq - s.cursor, 0) + len(s.skipped) for s in states),
            in_flight=sum(len(s.leases) for s in states),
            retrying=sum(len(s.retries) for s in states),
            dead=sum(len(s.dead) for s in states),
            acked=sum(s.acked for s in states),
            filtered=sum(s.filtered for s in states),
            tags=list(self.tags or ()),
        )

    def snapshot(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "mode": self.mode,
            "states": {k: s.snapshot() for k, s in self.states.items()},
        }
        if self.tags != ():
            doc["tags"] = None if self.tags is None else list(self.tags)
        return doc

    @classmethod
    def restore(cls, subject: str, name: str, doc: dict[str, Any]) -> Group:
        tags = doc.get("tags", ())  # absent: no filter (and every older checkpoint)
        group = cls(
            subject=subject,
            name=name,
            mode=str(doc["mode"]),
            tags=None if tags is None else tuple(tags),
        )
        for key, state in doc["states"].items():
            group.states[key] = DeliveryState.restore(state)
        return group


class GroupTable(Mapping[tuple[str, str], Group]):
    """Every consumer group by (subject, group); changed only by ``apply``.

    ``apply`` is what live traffic (through ``ActionLog.record``) and recovery (replaying
    the action log) both call, so a restart rebuilds exactly the state the broker had.
    """

    def __init__(self, groups: dict[tuple[str, str], Group] | None = None) -> None:
        self._groups = groups if groups is not None else {}

    def __getitem__(self, key: tuple[str, str]) -> Group:
        return self._groups[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def apply(self, record: ActionRecord) -> None:
        """Apply one action record to the group states."""
        key = (record.subject, record.group)
        group = self._groups.get(key)
        if record.type is ActionType.GROUP:
            if group is None:
                group = self._groups[key] = Group(
                    subject=record.subject, name=record.group, mode=str(record.fields["mode"])
                )
            if "tags" in record.fields:  # fixes the filter (absent: none, or already fixed)
                group.tags = tuple(record.fields["tags"])
            if record.state not in group.states:
                group.states[record.state] = DeliveryState(int(record.fields["cursor"]))
            return
        if group is None:
            return
        if record.type is ActionType.RESET:
            group.tags = None  # a reset frees the tag filter: the next pull fixes it again
        state = group.states.get(record.state)
        if state is not None:
            state.apply(record)

    def of_subject(self, subject: str) -> list[Group]:
        return [group for (s, _), group in sorted(self._groups.items()) if s == subject]

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Checkpoint form: ``{subject: {group: doc}}``."""
        out: dict[str, dict[str, Any]] = {}
        for (subject, name), group in self._groups.items():
            out.setdefault(subject, {})[name] = group.snapshot()
        return out

    @classmethod
    def restore(cls, snapshot: Mapping[str, Mapping[str, Any]]) -> GroupTable:
        groups: dict[tuple[str, str], Group] = {}
        for subject, by_name in snapshot.items():
            for name, doc in by_name.items():
                groups[(subject, name)] = Group.restore(subject, name, doc)
        return cls(groups)
