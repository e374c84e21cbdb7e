"""Messages produced with a future ``deliver_at``: kept aside, stored in due order when due."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class DelayedMessage:
    envelope: dict[str, Any]
    body: bytes
    created_at_us: int  # the default ``created_at``: when it was accepted


class DelayedMessages:
    """By (subject, id), which is also how a resend of one is found a duplicate."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], DelayedMessage] = {}
        self._due: list[tuple[int, int, str, str]] = []  # (due, order, subject, id)
        self._order = itertools.count()

    def __contains__(self, subject_and_id: tuple[str, str]) -> bool:
        return subject_and_id in self._pending

    def add(self, message: DelayedMessage, due_us: int) -> None:
        subject, message_id = message.envelope["subject"], message.envelope["id"]
        self._pending[(subject, message_id)] = message
        heapq.heappush(self._due, (due_us, next(self._order), subject, message_id))

    def take_due(self, now_us: int) -> list[DelayedMessage]:
        """The messages due by ``now_us``, in due order, no longer kept here."""
        taken = []
        while self._due and self._due[0][0] <= now_us:
            _, _, subject, message_id = heapq.heappop(self._due)
            taken.append(self._pending.pop((subject, message_id)))
        return taken

    def next_due_us(self) -> int | None:
        return self._due[0][0] if self._due else None

    def of(self, subject: str) -> list[DelayedMessage]:
        """The messages of ``subject`` not due yet."""
        return [m for (name, _), m in self._pending.items() if name == subject]

    def holds(self, subject: str) -> bool:
        return any(name == subject for name, _ in self._pending)
