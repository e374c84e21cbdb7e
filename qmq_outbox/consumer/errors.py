"""The consumer's exceptions (all under ``QmqError``)."""

from __future__ import annotations

from datetime import timedelta

from qmq_outbox.errors import QmqError


class ConsumerError(QmqError):
    """The consumer failed."""


class ConsumerCrashed(ConsumerError):
    """A consumer loop died; the consumer stopped. The cause is chained."""


class RetryLater(QmqError):
    """The handler asked for the message to be delivered again after a delay.

    Raise it from a handler: the message is nacked with this delay instead of the
    broker's default backoff. It still counts as an attempt.
    """

    def __init__(self, delay: float | timedelta, reason: str = "") -> None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if seconds < 0:
            raise ValueError("RetryLater delay must not be negative")
        super().__init__(reason or f"retry in {seconds:g}s")
        self.delay = timedelta(seconds=seconds)
        self.reason = reason

    @property
    def delay_ms(self) -> int:
        return round(self.delay.total_seconds() * 1000)
