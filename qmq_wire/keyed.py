"""Per-key concurrency inside an ordered partition: what one pull may lease (pure logic).

A partition's messages are served in seq order, but a message is leased only when no
earlier message of its key is unfinished: leased, waiting for a retry, dead under
``on_dead: block``, or skipped (passed over below the cursor because its key was busy).
So different keys are in flight together and a slow or failing key holds back its own
messages only. ``max_keys`` bounds the keys with messages in flight (leased or retrying)
per partition. A pull that takes a key also takes that key's later messages it meets (in
seq order, run one after another by the consumer); the key's next ones wait for them all.

One source for the broker (whose state is rebuilt from the action log: the seqs from its
LEASE/ACK/RETRY/DEAD records, the skipped ones from the gaps a LEASE leaves, their keys from
the messages themselves) and for the in-memory test broker. ``docs/architecture.md``
section 3.6 is its prose.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Protocol


class Waiting(Protocol):
    """A retry: the attempts made so far, and when the next may start (microseconds)."""

    @property
    def attempts(self) -> int: ...

    @property
    def due_us(self) -> int: ...


class KeyedState(Protocol):
    """A group's delivery state on one partition, as far as choosing needs it."""

    @property
    def cursor(self) -> int: ...

    @property
    def leases(self) -> Mapping[int, object]: ...

    @property
    def retries(self) -> Mapping[int, Waiting]: ...

    @property
    def dead(self) -> Mapping[int, object]: ...

    @property
    def skipped(self) -> Collection[int]: ...


MAX_SKIPPED = 10_000
"""Messages of busy keys a partition may hold back below its cursor per group: once this
many wait, the partition serves only them (and retries) until some are done, which bounds
the state a poison key can grow."""
LOOK_AHEAD = 1_000
"""New messages a pull passes over at most after the last one it took: a partition whose
next thousand messages all belong to busy keys waits for one of them."""


def choose_keyed(
    state: KeyedState,
    *,
    key_of: Callable[[int], Hashable],
    limit: int,
    max_keys: int,
    end: int,
    now_us: int,
    block_dead: bool,
) -> tuple[list[int], list[int]]:
    """Seqs to lease now, in seq order, with their attempt numbers: due retries and skipped
    messages whose key is free, then new messages from the cursor up to ``end``, at most
    ``limit`` of them."""
    held: set[Hashable] = {key_of(seq) for seq in state.leases}
    in_flight = set(held)
    for seq, retry in state.retries.items():
        key = key_of(seq)
        in_flight.add(key)
        if retry.due_us > now_us:
            held.add(key)
    if block_dead:
        held.update(key_of(seq) for seq in state.dead)
    seen: set[Hashable] = set()  # keys met in this pull: taken, or passed over
    taken: set[Hashable] = set()
    seqs: list[int] = []
    attempts: list[int] = []

    def take(seq: int) -> bool:
        """Whether ``seq`` may be leased now: the next of a key taken in this pull, or the
        first of a free key while fewer than ``max_keys`` are in flight. A key met and
        passed over stays passed over in this pull."""
        key = key_of(seq)
        if key in taken:
            return True
        if key in seen:
            return False
        seen.add(key)
        if key in held:
            return False
        if key not in in_flight:
            if len(in_flight) >= max_keys:
                return False
            in_flight.add(key)
        taken.add(key)
        return True

    due = {seq: r.attempts + 1 for seq, r in state.retries.items() if r.due_us <= now_us}
    for seq in sorted(due.keys() | set(state.skipped)):
        if len(seqs) >= limit:
            return seqs, attempts
        if take(seq):
            seqs.append(seq)
            attempts.append(due.get(seq, 1))
    passed = 0  # new messages not taken since the last one taken: skipped if one is
    room = MAX_SKIPPED - len(state.skipped)
    seq = state.cursor
    while seq < end and len(seqs) < limit:
        if take(seq):
            seqs.append(seq)
            attempts.append(1)
            room -= passed
            passed = 0
        else:
            passed += 1
            if passed > min(room, LOOK_AHEAD) or (not taken and len(in_flight) >= max_keys):
                break
        seq += 1
    return seqs, attempts


def first_of_each_key(
    seqs: list[int], *, key_of: Callable[[int], Hashable]
) -> tuple[list[int], list[int]]:
    """A nack of an ordered partition's seqs split in two: the first of each key, whose
    attempt counts, and the rest, released without counting one (a consumer runs a key's
    messages in order and stops at the first that fails: the others never ran)."""
    first: list[int] = []
    rest: list[int] = []
    met: set[Hashable] = set()
    for seq in sorted(seqs):
        key = key_of(seq)
        (rest if key in met else first).append(seq)
        met.add(key)
    return first, rest
