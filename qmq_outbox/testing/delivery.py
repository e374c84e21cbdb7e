"""A consumer group's delivery state in one log, in memory: leases, retries, dead letters.

The same rules as the broker (``docs/architecture.md`` section 3.2): due retries before new
messages, an expired lease is a failed attempt, out of attempts means dead, redrive starts
the count again; an ordered subject's partition is served in seq order per key
(``qmq_wire.keyed``), or one batch at a time with ``max_keys`` 1 (section 3.6). Times are
microseconds of the in-memory broker's clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

from qmq_wire.delivery import RetryPolicy
from qmq_wire.keyed import choose_keyed, first_of_each_key

Matches = Callable[[int], bool]
"""Whether the seq passes the group's tag filter (None: no filter)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """A leased seq: by whom, which attempt, until when."""

    consumer: str
    attempt: int
    deadline_us: int


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """A seq to deliver again once due, after ``attempts`` attempts."""

    attempts: int
    due_us: int


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead letter."""

    attempts: int
    error: str | None
    at_us: int


class DeliveryState:
    """Where one state owner (a shared group, or one consumer of a broadcast group) stands."""

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor
        self.leases: dict[int, Lease] = {}
        self.retries: dict[int, Retry] = {}
        self.dead: dict[int, DeadLetter] = {}
        self.acked: set[int] = set()
        self.skipped: set[int] = set()  # ordered: below the cursor, passed over, not leased
        self.filtered = 0  # seqs the group's tag filter skipped: never leased

    def expire(self, *, now_us: int, policy: RetryPolicy) -> None:
        for seq, lease in sorted(self.leases.items()):
            if lease.deadline_us > now_us:
                continue
            del self.leases[seq]
            if lease.attempt >= policy.max_attempts:
                self.dead[seq] = DeadLetter(lease.attempt, "lease expired", now_us)
            else:
                self.retries[seq] = Retry(lease.attempt, now_us)

    def lease(
        self,
        *,
        consumer: str,
        limit: int,
        end_seq: int,
        now_us: int,
        policy: RetryPolicy,
        matches: Matches | None = None,
    ) -> list[tuple[int, int]]:
        """Lease up to ``limit`` seqs (due retries first); returns (seq, attempt) pairs.
        New seqs ``matches`` refuses are skipped: the cursor passes them, nothing leases."""
        due = sorted((w.due_us, seq) for seq, w in self.retries.items() if w.due_us <= now_us)
        chosen = [(seq, self.retries.pop(seq).attempts + 1) for _, seq in due[:limit]]
        self._take_new(chosen, limit, end_seq, matches)
        return self._hold(chosen, consumer, now_us + policy.ack_timeout_us)

    def lease_in_order(
        self,
        *,
        consumer: str,
        limit: int,
        end_seq: int,
        now_us: int,
        policy: RetryPolicy,
        hold_on_dead: bool,
        max_keys: int = 1,
        key_of: Callable[[int], Hashable] | None = None,
    ) -> list[tuple[int, int]]:
        """An ordered partition's next batch, in seq order. ``max_keys`` above 1 (or with
        messages skipped): per key, as ``choose_keyed``. Else nothing while a message is
        leased (or, ``hold_on_dead``, while one is dead); its retries once due, the oldest
        one not due holding back everything after it; else new messages."""
        if key_of is not None and (max_keys > 1 or self.skipped):
            seqs, attempts = choose_keyed(
                self,
                key_of=key_of,
                limit=limit,
                max_keys=max_keys,
                end=end_seq,
                now_us=now_us,
                block_dead=hold_on_dead,
            )
            for seq in seqs:
                self.retries.pop(seq, None)
                self.skipped.discard(seq)
                if seq > self.cursor:
                    self.skipped.update(range(self.cursor, seq))
                self.cursor = max(self.cursor, seq + 1)
            return self._hold(
                list(zip(seqs, attempts, strict=True)),
                consumer,
                deadline_us=now_us + policy.ack_timeout_us,
            )
        if self.leases or (hold_on_dead and self.dead):
            return []
        chosen: list[tuple[int, int]] = []
        if self.retries:
            for seq in sorted(self.retries):
                waiting = self.retries[seq]
                if waiting.due_us > now_us or len(chosen) >= limit:
                    break
                chosen.append((seq, waiting.attempts + 1))
            for seq, _ in chosen:
                del self.retries[seq]
        else:
            self._take_new(chosen, limit, end_seq)
        return self._hold(chosen, consumer, now_us + policy.ack_timeout_us)

    def _take_new(
        self,
        chosen: list[tuple[int, int]],
        limit: int,
        end_seq: int,
        matches: Matches | None = None,
    ) -> None:
        """Add never-delivered seqs from the cursor to ``chosen``, up to ``limit`` in all,
        skipping (and counting) those ``matches`` refuses."""
        while len(chosen) < limit and self.cursor < end_seq:
            if matches is not None and not matches(self.cursor):
                self.filtered += 1
            else:
                chosen.append((self.cursor, 1))
            self.cursor += 1
        while matches is not None and self.cursor < end_seq and not matches(self.cursor):
            self.filtered += 1  # skipped past the last match, as the broker does
            self.cursor += 1

    def _hold(
        self, chosen: list[tuple[int, int]], consumer: str, deadline_us: int
    ) -> list[tuple[int, int]]:
        for seq, attempt in chosen:
            self.leases[seq] = Lease(consumer, attempt, deadline_us)
        return chosen

    def ready(self, *, end_seq: int, now_us: int, matches: Matches | None = None) -> int:
        """How many seqs ``lease`` would hand out now, at most."""
        due = sum(1 for w in self.retries.values() if w.due_us <= now_us)
        if matches is not None:
            return due + sum(1 for seq in range(self.cursor, end_seq) if matches(seq))
        return due + max(end_seq - self.cursor, 0)

    def holds(self, seq: int, consumer: str) -> bool:
        """Only the consumer holding a lease may ack or nack it."""
        lease = self.leases.get(seq)
        return lease is not None and lease.consumer == consumer

    def ack(self, seqs: list[int]) -> None:
        for seq in seqs:
            if self.leases.pop(seq, None) is not None:
                self.acked.add(seq)

    def nack(
        self,
        seqs: list[int],
        *,
        consumer: str,
        now_us: int,
        delay_us: int | None,
        error: str | None,
        policy: RetryPolicy,
        key_of: Callable[[int], Hashable] | None = None,
    ) -> tuple[int, int]:
        """Retry or bury the ones among ``seqs`` that ``consumer`` holds; (retrying, dead).
        With ``key_of`` (an ordered partition) only the first of each key counts an
        attempt: the others are released as they were (``first_of_each_key``)."""
        held = [seq for seq in seqs if self.holds(seq, consumer)]
        released: list[int] = []
        if key_of is not None:
            held, released = first_of_each_key(held, key_of=key_of)
        for seq in released:
            lease = self.leases.pop(seq)
            self.retries[seq] = Retry(lease.attempt - 1, now_us)
        retrying, dead = len(released), 0
        for seq in held:
            lease = self.leases.pop(seq)
            if lease.attempt >= policy.max_attempts:
                self.dead[seq] = DeadLetter(lease.attempt, error, now_us)
                dead += 1
            else:
                wait = delay_us if delay_us is not None else policy.backoff_us(lease.attempt)
                self.retries[seq] = Retry(lease.attempt, now_us + wait)
                retrying += 1
        return retrying, dead

    def redrive(self, seqs: list[int] | None, *, now_us: int) -> int:
        chosen = list(self.dead) if seqs is None else [s for s in seqs if s in self.dead]
        for seq in chosen:
            del self.dead[seq]
            self.retries[seq] = Retry(0, now_us)
        return len(chosen)

    def reset(self, cursor: int) -> None:
        """Read from ``cursor`` next: leases dropped, retries, dead letters and passed-over
        seqs at or after it gone (their messages come again from there), those before it
        kept."""
        self.cursor = cursor
        self.leases.clear()
        self.retries = {s: r for s, r in self.retries.items() if s < cursor}
        self.dead = {s: d for s, d in self.dead.items() if s < cursor}
        self.skipped = {s for s in self.skipped if s < cursor}

    def next_due_us(self) -> int | None:
        """When a lease expires or a retry comes due next."""
        times = [w.due_us for w in self.retries.values()]
        times += [h.deadline_us for h in self.leases.values()]
        return min(times, default=None)


@dataclasses.dataclass(slots=True)
class GroupState:
    """A consumer group on one log: its mode, its tag filter (fixed by its first pull; empty:
    none; None: not fixed, after a reset) and its state owners (by ``owner_key``)."""

    name: str
    mode: str
    owners: dict[str, DeliveryState] = dataclasses.field(default_factory=dict)
    tags: tuple[str, ...] | None = ()

    def owner_key(self, consumer: str) -> str:
        return consumer if self.mode == "broadcast" else ""

    def stats(self, end_seq: int) -> dict[str, Any]:
        owners = list(self.owners.values())
        return {
            "group": self.name,
            "mode": self.mode,
            "backlog": sum(max(end_seq - s.cursor, 0) + len(s.skipped) for s in owners),
            "in_flight": sum(len(s.leases) for s in owners),
            "retrying": sum(len(s.retries) for s in owners),
            "dead": sum(len(s.dead) for s in owners),
            "acked": sum(len(s.acked) for s in owners),
            "filtered": sum(s.filtered for s in owners),
            "tags": list(self.tags or ()),
        }
