"""Ordered handlers' bookkeeping: one lane per key of a partition, run by one worker at a time.

A lane holds the pulled messages of one key in one partition of an ordered subject that no
handler has started yet, in the order the broker served them (seq order). The runner
queues a lane for its workers when it gets its first message; the worker that takes it
runs its messages one after another until it is empty, and only then may the lane be
queued again, so one key's handlers never overlap while different keys' (of one partition
or of several) run side by side. Pure bookkeeping on the consumer's loop; the runner owns
the I/O.
"""

from __future__ import annotations

from collections import deque

from qmq_outbox.envelope import Message
from qmq_wire.ordered import partition_log


class Lane:
    """One key's messages in one partition waiting for their turn."""

    __slots__ = ("key", "message_key", "partition", "scheduled", "subject", "waiting")

    def __init__(self, subject: str, partition: int | None, message_key: str | None) -> None:
        self.subject = subject
        self.partition = partition
        self.message_key = message_key
        # The acker's name for the partition: the log name ``subject#p``, which no plain
        # subject can have, so acks of different partitions never share a request.
        self.key = subject if partition is None else partition_log(subject, partition)
        self.waiting: deque[Message] = deque()
        self.scheduled = False  # queued for a worker, or being run by one

    def take_rest(self) -> list[Message]:
        """Every message still waiting, oldest first; the lane is empty afterwards."""
        rest = list(self.waiting)
        self.waiting.clear()
        return rest


class Lanes:
    """The lanes of every ordered subject this consumer pulls."""

    def __init__(self) -> None:
        self._lanes: dict[tuple[str, int | None, str | None], Lane] = {}

    def add(self, message: Message) -> Lane | None:
        """Queue ``message`` on its key's lane; returns the lane when a worker must be
        given it (it was idle), None when one already has it."""
        where = (message.subject, message.partition, message.key)
        lane = self._lanes.get(where)
        if lane is None:
            lane = self._lanes[where] = Lane(*where)
        lane.waiting.append(message)
        if lane.scheduled:
            return None
        lane.scheduled = True
        return lane

    def next(self, lane: Lane) -> Message | None:
        """The lane's next message to run; None once it is empty, and then the lane is idle
        (a later message schedules it anew)."""
        if lane.waiting:
            return lane.waiting.popleft()
        lane.scheduled = False
        where = (lane.subject, lane.partition, lane.message_key)
        if self._lanes.get(where) is lane:
            del self._lanes[where]
        return None

    def take_all(self) -> list[tuple[Lane, list[Message]]]:
        """Every lane's waiting messages (at a stop: they go back to the broker)."""
        taken = [(lane, lane.take_rest()) for lane in self._lanes.values()]
        return [(lane, rest) for lane, rest in taken if rest]

    def __len__(self) -> int:
        """Messages waiting in all lanes."""
        return sum(len(lane.waiting) for lane in self._lanes.values())
