"""Ack batching: acks are buffered per subject and sent when ``max_size`` are waiting, when
the oldest has waited ``interval`` seconds, or at once when hurried (a puller is waiting
for the lease slots these acks still hold). Pure bookkeeping; the runners own the I/O."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

MAX_SEQS_PER_REQUEST = 1000


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class AckBuffer:
    """Not thread-safe: the threaded runner guards it with its condition."""

    max_size: int
    interval: float
    urgent: bool = dataclasses.field(init=False, default=False)
    _pending: dict[str, list[int]] = dataclasses.field(init=False, default_factory=dict)
    _count: int = dataclasses.field(init=False, default=0)
    _oldest: float | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.max_size < 1 or self.interval < 0:
            raise ValueError("max_size must be >= 1 and interval >= 0")

    def __len__(self) -> int:
        return self._count

    def add(self, subject: str, seq: int, now: float) -> bool:
        """Buffer one ack; True when the buffer is full and should be sent now."""
        self._pending.setdefault(subject, []).append(seq)
        self._count += 1
        if self._oldest is None:
            self._oldest = now
        return self._count >= self.max_size

    def hurry(self) -> None:
        """Send what is buffered now, or the next ack as soon as it comes."""
        self.urgent = True

    def due_in(self, now: float) -> float | None:
        """Seconds until a flush is due (0: now), None while empty."""
        if self._oldest is None:
            return None
        if self._count >= self.max_size or self.urgent:
            return 0.0
        return max(0.0, self._oldest + self.interval - now)

    def take(self) -> dict[str, list[int]]:
        pending, self._pending = self._pending, {}
        self._count = 0
        self._oldest = None
        if pending:
            self.urgent = False
        return pending

    def take_subject(self, subject: str, limit: int = MAX_SEQS_PER_REQUEST) -> list[int]:
        """Up to ``limit`` of one subject's acks, oldest first, for a pull to carry."""
        pending = self._pending.get(subject)
        if not pending:
            return []
        taken, rest = pending[:limit], pending[limit:]
        if rest:
            self._pending[subject] = rest
        else:
            del self._pending[subject]
        self._count -= len(taken)
        if not self._count:
            self._oldest = None
            self.urgent = False
        return taken

    def put_back(self, batch: dict[str, list[int]], now: float) -> None:
        """Return acks that could not be sent; they go out with the next flush."""
        for subject, seqs in batch.items():
            for seq in seqs:
                self.add(subject, seq, now)


def chunks(seqs: list[int], size: int = MAX_SEQS_PER_REQUEST) -> Iterable[list[int]]:
    for start in range(0, len(seqs), size):
        yield seqs[start : start + size]
