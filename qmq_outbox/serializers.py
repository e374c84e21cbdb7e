"""Message body serializers: JSON by default, bytes passed through, pluggable.

The default ``JsonSerializer`` writes what a SQLAlchemy or FastAPI app holds without
conversion code (the table is in docs/outbox.md): orjson's own types (``str``, numbers,
``bool``, ``None``, lists, tuples, dicts with ``str`` keys, ``datetime``, ``date``,
``time``, ``UUID``, ``Enum`` as its value, dataclasses), plus ``Decimal`` and pydantic
models through orjson's ``default=`` hook, at any depth. Anything else raises
``SerializationError`` naming the type.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Literal, Protocol, runtime_checkable

import orjson

from qmq_outbox.errors import ConfigurationError, SerializationError

OCTET_STREAM = "application/octet-stream"
DecimalFormat = Literal["string", "number"]


@runtime_checkable
class Serializer(Protocol):
    """Turns a body value into bytes; ``content_type`` is stored with the outbox row."""

    content_type: str

    def dumps(self, value: Any) -> bytes: ...


class JsonSerializer:
    """JSON via orjson; the default serializer.

    ``decimal="string"`` (the default) writes a ``Decimal`` as a JSON string of its exact
    digits (``"12.30"``), which every JSON parser keeps as it is; ``"number"`` writes the
    same digits as a JSON number (``12.30``), which most parsers read into a binary float.
    Datetimes are RFC 3339 with their offset; a naive one is taken as UTC (``+00:00``).
    ``option`` adds orjson flags (``orjson.OPT_SORT_KEYS``, ...).
    """

    content_type = "application/json"

    def __init__(self, *, decimal: DecimalFormat = "string", option: int | None = None) -> None:
        if decimal not in ("string", "number"):
            raise ConfigurationError(f"decimal must be 'string' or 'number', not {decimal!r}")
        self._decimal_as_number = decimal == "number"
        self._option = orjson.OPT_NAIVE_UTC | (option or 0)

    def dumps(self, value: Any) -> bytes:
        try:
            return orjson.dumps(value, default=self._default, option=self._option)
        except orjson.JSONEncodeError as exc:
            # orjson reports the default hook's own error as the cause: it names the type.
            raise SerializationError(f"cannot serialize as JSON: {exc.__cause__ or exc}") from exc

    def _default(self, value: Any) -> Any:
        """orjson calls this for each value it has no encoding of, at any depth."""
        if isinstance(value, Decimal):
            return self._encode_decimal(value)
        model_dump = getattr(value, "model_dump", None)
        if model_dump is not None and not isinstance(value, type):  # a pydantic model
            return model_dump(mode="json")
        raise TypeError(f"{_type_name(value)} is not JSON serializable")

    def _encode_decimal(self, value: Decimal) -> Any:
        if not self._decimal_as_number:
            return str(value)
        if not value.is_finite():
            raise TypeError(f"Decimal('{value}') is not a JSON number")
        return orjson.Fragment(str(value))  # Decimal's str is a valid JSON number when finite


def _type_name(value: object) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


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
