"""What the dispatcher holds: the backlog of unkeyed messages, the lanes of keyed ones,
and the batches a sender takes from them. None of it is thread-safe by itself."""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Callable, Sequence

from sqlalchemy.engine import Engine

from qmq_outbox.envelope import OutgoingMessage

Item = tuple[Engine, OutgoingMessage]


class Backlog:
    """A bounded FIFO of (engine, message); not thread-safe by itself."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.deque[Item] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> bool:
        """Take all of ``messages`` or none of them."""
        if len(self._items) + len(messages) > self.capacity:
            return False
        self._items.extend((engine, m) for m in messages)
        return True

    def take(self, limit: int) -> list[Item]:
        count = min(limit, len(self._items))
        return [self._items.popleft() for _ in range(count)]

    def put_back(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> None:
        """Messages of a failed send go back to the front (over ``capacity`` if need be:
        they were in it moments ago)."""
        self._items.extendleft((engine, m) for m in reversed(messages))

    def drop(self, keep: Callable[[OutgoingMessage], bool]) -> int:
        """Remove the messages ``keep`` refuses; returns how many."""
        before = len(self._items)
        self._items = collections.deque(item for item in self._items if keep(item[1]))
        return before - len(self._items)

    def clear(self) -> int:
        count = len(self._items)
        self._items.clear()
        return count


@dataclasses.dataclass(slots=True)
class Keyed:
    """A keyed message in its lane: held back ``holds`` times so far, not taken before
    ``due`` (``time.monotonic()``)."""

    engine: Engine
    message: OutgoingMessage
    holds: int = 0
    due: float = 0.0

    @property
    def order_key(self) -> tuple[str, str | None]:
        return self.message.subject, self.message.key


class KeyLanes:
    """Keyed messages in ``count`` lanes, one per sender; a (subject, key) always lands in
    the same lane. Not thread-safe by itself."""

    def __init__(self, count: int) -> None:
        self._lanes: list[collections.deque[Keyed]] = [
            collections.deque() for _ in range(max(1, count))
        ]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes)

    def lane_of(self, message: OutgoingMessage) -> int:
        return zlib.crc32(f"{message.subject}\0{message.key}".encode()) % len(self._lanes)

    def add(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> None:
        for message in messages:
            self._lanes[self.lane_of(message)].append(Keyed(engine, message))

    def is_empty(self, lane: int) -> bool:
        return not self._lanes[lane]

    def take(self, lane: int, limit: int, now: float) -> list[Keyed]:
        """Up to ``limit`` due messages of ``lane``, oldest first. A key with a message not
        due yet keeps its later messages back too: they could not go before it."""
        queue = self._lanes[lane]
        taken: list[Keyed] = []
        kept: list[Keyed] = []
        waiting: set[tuple[str, str | None]] = set()
        while queue and len(taken) < limit:
            entry = queue.popleft()
            if entry.due > now or entry.order_key in waiting:
                waiting.add(entry.order_key)
                kept.append(entry)
            else:
                taken.append(entry)
        queue.extendleft(reversed(kept))
        return taken

    def put_back(self, lane: int, entries: Sequence[Keyed]) -> None:
        """Held messages go back to the front of their lane: they are older than the rest."""
        self._lanes[lane].extendleft(reversed(entries))

    def drop(self, keep: Callable[[OutgoingMessage], bool]) -> int:
        """Remove the messages ``keep`` refuses, from every lane; returns how many."""
        dropped = 0
        for index, lane in enumerate(self._lanes):
            kept = collections.deque(entry for entry in lane if keep(entry.message))
            dropped += len(lane) - len(kept)
            self._lanes[index] = kept
        return dropped

    def next_due(self, lane: int, now: float) -> float | None:
        """When the next held message of ``lane`` falls due; None if none waits. (One that
        is due but behind a held message of its key waits for that one's time.)"""
        return min((e.due for e in self._lanes[lane] if e.due > now), default=None)


@dataclasses.dataclass(slots=True)
class Batch:
    """What one sender took: unkeyed messages from the backlog, keyed ones from its lane."""

    lane: int
    plain: list[Item] = dataclasses.field(default_factory=list)
    keyed: list[Keyed] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.plain or self.keyed)


@dataclasses.dataclass(slots=True)
class Send:
    """One engine's part of a batch."""

    engine: Engine
    plain: list[OutgoingMessage] = dataclasses.field(default_factory=list)
    keyed: list[Keyed] = dataclasses.field(default_factory=list)


def by_engine(batch: Batch) -> list[Send]:
    grouped: dict[Engine, Send] = {}
    for engine, message in batch.plain:
        grouped.setdefault(engine, Send(engine)).plain.append(message)
    for entry in batch.keyed:
        grouped.setdefault(entry.engine, Send(entry.engine)).keyed.append(entry)
    return list(grouped.values())
