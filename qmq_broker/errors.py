"""The broker's exceptions: one root, subclasses by concern.

Core errors carry a stable code (``qmq_wire.ERROR_STATUS`` lists them), a message and the
request field they name; they know nothing of HTTP. ``qmq_broker.http`` turns a code into a
status and the error into the JSON body of the answer.
"""

from __future__ import annotations


class QmqBrokerError(Exception):
    """A broker operation failed."""


class CorruptRecord(QmqBrokerError):
    """A record on disk is cut short or fails its CRC; it is never served as a message."""

    def __init__(self, *, path: str, offset: int, reason: str) -> None:
        super().__init__(f"{path} at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class StorageError(QmqBrokerError):
    """The data directory could not be read or written."""


class ConfigError(QmqBrokerError):
    """The broker was configured with a value it cannot work with."""


class RequestError(QmqBrokerError):
    """A request cannot be served as asked: a code, a message and the field it names."""

    def __init__(
        self,
        *,
        code: str,
        message: str,
        field: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s


class Invalid(RequestError):
    """The request breaks a rule of the API (a field's value, a size limit)."""


class NotFound(RequestError):
    """The request names a subject, group or consumer the broker does not know."""


class Conflict(RequestError):
    """The request contradicts state the broker already has (e.g. a group's mode)."""


class Denied(RequestError):
    """The request has no valid token, or its token lacks the right it needs."""


class Overloaded(RequestError):
    """A group has as many pulls pending as its mailbox holds; retry after a moment."""


class Unavailable(RequestError):
    """The broker is recovering, shutting down or read-only and cannot serve this now."""
