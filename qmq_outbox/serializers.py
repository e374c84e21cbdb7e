"""Message body serializers: JSON by default, bytes passed through, pluggable."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import orjson

from qmq_outbox.errors import SerializationError

OCTET_STREAM = "application/octet-stream"


@runtime_checkable
class Serializer(Protocol):
    """Turns a body value into bytes; ``content_type`` is stored with the outbox row."""

    content_type: str

    def dumps(self, value: Any) -> bytes: ...


class JsonSerializer:
    """JSON via orjson (datetimes, UUIDs, dataclasses included); the default."""

    content_type = "application/json"

    def __init__(self, *, option: int | None = None) -> None:
        self._option = option

    def dumps(self, value: Any) -> bytes:
        return orjson.dumps(value, option=self._option)


def serialize(value: Any, serializer: Serializer) -> tuple[bytes, str]:
    """The body bytes and content type; ``bytes`` (and bytearray/memoryview) pass unchanged."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), OCTET_STREAM
    try:
        return serializer.dumps(value), serializer.content_type
    except SerializationError:
        raise
    except Exception as exc:
        raise SerializationError(
            f"cannot serialize a {type(value).__name__} body as {serializer.content_type}: {exc}"
        ) from exc
