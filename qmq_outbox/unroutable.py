"""Warnings about unroutable messages: one line per subject per interval.

A message no queue is bound for (RabbitMQ without a consumer group yet) stays pending and
is tried again with backoff; the dispatcher and the compensator would otherwise write a
line per attempt while the consumers are not deployed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from qmq_outbox.failure_log import IntervalLog


class SubjectWarnings(IntervalLog):
    """Writes ``action`` at WARNING for a subject at most once per ``interval`` seconds,
    counting the messages met in between. Thread-safe; the clock is injectable."""

    def __init__(
        self,
        *,
        logger: logging.Logger,
        action: str,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(logger=logger, action=action, summary_interval=interval, clock=clock)
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def note(self, subject: str, count: int, reason: str, what_next: str) -> bool:
        """Count ``count`` unroutable messages of ``subject``; True if a line was written."""
        now = self._clock()
        with self._lock:
            total = self._count.get(subject, 0) + count
            last = self._last.get(subject)
            if last is not None and not self._due(last, now):
                self._count[subject] = total
                return False
            self._last[subject] = now
            self._count[subject] = 0
        self._logger.warning(
            "%d message(s) of subject %s unroutable: %s; %s",
            total,
            subject,
            reason,
            what_next,
            extra={"action": self._action, "subject": subject, "count": total},
        )
        return True
