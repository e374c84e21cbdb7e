"""The SDK's exceptions: one root, subclasses by concern."""

from __future__ import annotations


class QmqError(Exception):
    """A qmq-outbox operation failed."""


class ConfigurationError(QmqError):
    """The SDK was configured or called in a way it cannot work with."""


class BrokerError(QmqError):
    """The broker could not be reached or answered with an error."""


class BrokerUnavailable(BrokerError):
    """The broker is unreachable, timed out, or answered 429/5xx: try again later."""


class BrokerRejected(BrokerError):
    """The broker rejected the request as invalid (4xx other than 429): retrying won't help."""

    def __init__(self, *, status: int, code: str, message: str, field: str | None = None) -> None:
        where = f" ({field})" if field else ""
        super().__init__(f"broker answered {status} {code}{where}: {message}")
        self.status = status
        self.code = code
        self.field = field


class SerializationError(QmqError):
    """A message body could not be serialized."""
