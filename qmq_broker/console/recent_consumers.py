"""Which consumers each group heard from lately: noted on every pull, ack and nack.

In memory only, bounded: at most ``per_group`` consumers per group (the one heard from
longest ago makes room) and ``max_groups`` groups (likewise). A note is two dict operations,
cheap enough for the pull path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

GroupKey = tuple[str, str]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RecentConsumer:
    consumer: str
    seconds_ago: float


class RecentConsumers:
    """Last time (monotonic seconds) each consumer of a (subject, group) called the broker."""

    def __init__(
        self,
        *,
        now: Callable[[], float],
        per_group: int = 100,
        max_groups: int = 10_000,
    ) -> None:
        self._now = now
        self._per_group = per_group
        self._max_groups = max_groups
        # Insertion order is recency order: a note moves its consumer (and group) to the end.
        self._groups: dict[GroupKey, dict[str, float]] = {}

    def saw(self, subject: str, group: str, consumer: str) -> None:
        key = (subject, group)
        consumers = self._groups.pop(key, None)
        if consumers is None:
            consumers = {}
            if len(self._groups) >= self._max_groups:
                del self._groups[next(iter(self._groups))]
        self._groups[key] = consumers
        consumers.pop(consumer, None)
        consumers[consumer] = self._now()
        if len(consumers) > self._per_group:
            del consumers[next(iter(consumers))]

    def recent(self, subject: str, group: str, *, within_s: float) -> list[RecentConsumer]:
        """The consumers heard from within ``within_s``, the latest first."""
        consumers = self._groups.get((subject, group))
        if not consumers:
            return []
        now = self._now()
        found = [
            RecentConsumer(consumer=name, seconds_ago=max(now - at, 0.0))
            for name, at in reversed(consumers.items())
            if now - at <= within_s
        ]
        return found
