"""The SDK's exceptions: one root (``QmqError``), subclasses by concern.

Driver errors (httpx, SQLAlchemy) are translated into these once, where they are raised,
with the cause chained; callers never parse driver errors.
"""

from __future__ import annotations

from datetime import timedelta


class QmqError(Exception):
    """A qmq-outbox operation failed."""


class ConfigurationError(QmqError):
    """The SDK was configured or called in a way it cannot work with."""


class UnsupportedByTransport(ConfigurationError):
    """The chosen transport cannot do this (delayed delivery, ordered or broadcast
    consumption); docs/transports.md lists what each transport offers."""


class InvalidMessage(ConfigurationError, ValueError):
    """The message cannot be published as given (bad subject, id, key, headers or time)."""


class SerializationError(QmqError):
    """A message body could not be serialized."""


# -- the broker ------------------------------------------------------------------------------


class BrokerError(QmqError):
    """The broker could not be reached or answered with an error."""


class BrokerUnavailable(BrokerError):
    """The broker is unreachable, timed out, or answered 429/5xx: try again later."""


class BrokerRejected(BrokerError):
    """The broker rejected the request as invalid (4xx other than 429): retrying won't help.

    ``status`` is the qmq broker's HTTP status; None when another transport (JetStream,
    RabbitMQ) refused a message, whose ``message`` then names it."""

    def __init__(
        self, *, status: int | None, code: str, message: str, field: str | None = None
    ) -> None:
        where = f" ({field})" if field else ""
        if status is None:
            super().__init__(f"rejected ({code}){where}: {message}")
        else:
            super().__init__(f"broker answered {status} {code}{where}: {message}")
        self.status = status
        self.code = code
        self.field = field


# -- the producer's database -------------------------------------------------------------------


class OutboxStoreError(QmqError):
    """The outbox table could not be read or written."""


# -- the consumer -----------------------------------------------------------------------------


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


class IdempotentStoreError(QmqError):
    """The idempotent store's own database statement failed (the cause is chained)."""


class DuplicateMessage(QmqError):
    """This consumer group already consumed the message (the ``pk_qmq_consumed`` violation)."""


class ClaimHeld(QmqError):
    """Another consumer holds an unexpired claim on this message: retry after ``retry_after``."""

    def __init__(self, message: str, *, retry_after: timedelta) -> None:
        super().__init__(message)
        self.retry_after = retry_after
