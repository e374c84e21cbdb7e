"""The broker's exceptions: one root, subclasses by concern."""

from __future__ import annotations


class BrokerError(Exception):
    """A broker operation failed."""


class CorruptRecord(BrokerError):
    """A record on disk is cut short or fails its CRC; it is never served as a message."""

    def __init__(self, *, path: str, offset: int, reason: str) -> None:
        super().__init__(f"{path} at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class StorageError(BrokerError):
    """The data directory could not be read or written."""


class RequestError(BrokerError):
    """A request is invalid; carries the HTTP status, an error code and the field it names."""

    def __init__(
        self,
        *,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}


class Unavailable(RequestError):
    """The broker is recovering or shutting down and cannot serve this request now."""

    def __init__(self, *, code: str, message: str) -> None:
        super().__init__(status=503, code=code, message=message)
