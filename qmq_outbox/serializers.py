"""Message body serializers: JSON by default, bytes passed through, pluggable.

The default ``JsonSerializer`` writes what a SQLAlchemy or FastAPI app holds without
conversion code, by the rules in docs/outbox.md: orjson's own types, ``Decimal``,
datetimes in one RFC 3339 form (UTC, ``Z``), dataclasses and pydantic models, at any
depth. It refuses ORM-mapped objects, NaN and infinities, and anything else it has no rule
for, with a ``SerializationError`` naming where in the body the value is.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any, Literal, Protocol, runtime_checkable

import orjson

from qmq_outbox.body_models import is_orm_mapped, is_pydantic_model, model_value, orm_refusal
from qmq_outbox.body_paths import ROOT, find_refusal, has_non_finite, non_finite, refuse, type_name
from qmq_outbox.envelope import format_timestamp
from qmq_outbox.errors import ConfigurationError, SerializationError

OCTET_STREAM = "application/octet-stream"
DecimalFormat = Literal["string", "number"]
# Datetimes and dataclasses come to ``_convert``: one datetime form, no ORM dataclasses.
_OWN_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
_FIND_NULL = re.compile(b"null").search  # faster than `in` for a 4-byte needle


@runtime_checkable
class Serializer(Protocol):
    """Turns a body value into bytes; ``content_type`` is stored with the outbox row."""

    content_type: str

    def dumps(self, value: Any) -> bytes: ...


class JsonSerializer:
    """JSON via orjson; the default serializer.

    ``decimal="string"`` (the default) writes a ``Decimal`` as a JSON string of its exact
    digits (``"12.30"``); ``"number"`` writes the same digits as a JSON number (``12.30``),
    which most parsers read into a binary float. ``option`` adds orjson flags
    (``orjson.OPT_SORT_KEYS``, ...); datetimes and dataclasses keep the SDK's rules.
    """

    content_type = "application/json"

    def __init__(self, *, decimal: DecimalFormat = "string", option: int | None = None) -> None:
        if decimal not in ("string", "number"):
            raise ConfigurationError(f"decimal must be 'string' or 'number', not {decimal!r}")
        self._decimal_as_number = decimal == "number"
        self._option = (option or 0) | _OWN_OPTIONS
        self._str_keys = not self._option & orjson.OPT_NON_STR_KEYS
        self._dataclass_fields: dict[type, tuple[str, ...]] = {}  # of classes not ORM-mapped

    def dumps(self, value: Any) -> bytes:
        try:
            out = orjson.dumps(value, default=self._default, option=self._option)
        except orjson.JSONEncodeError as exc:
            find_refusal(value, self._convert, str_keys=self._str_keys)  # raises, with a path
            raise SerializationError(f"cannot serialize as JSON: {exc.__cause__ or exc}") from exc
        # orjson writes a NaN or an infinity as null: was there one?
        if _FIND_NULL(out) and has_non_finite(value, self._convert_shallow):
            find_refusal(value, self._convert_shallow, str_keys=self._str_keys)
        return out

    def _default(self, value: Any) -> Any:
        """orjson calls this for each value it has no encoding of, at any depth."""
        return self._convert(value, ROOT)

    def _convert(self, value: Any, path: str) -> Any:
        names = self._dataclass_fields.get(type(value))
        if names is not None:
            return {name: getattr(value, name) for name in names}
        if isinstance(value, datetime):
            try:
                return format_timestamp(value)
            except OverflowError:
                raise refuse(path, f"{value!r} is out of range in UTC") from None
        if isinstance(value, Decimal):
            return self._encode_decimal(value, path)
        if isinstance(value, date | time):  # orjson hands these over with datetimes
            if isinstance(value, time) and value.tzinfo is not None:
                raise refuse(path, "a time with a tzinfo; publish a datetime")
            return value.isoformat()
        if is_orm_mapped(value):
            raise orm_refusal(value, path)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names = tuple(f.name for f in dataclasses.fields(value))
            self._dataclass_fields[type(value)] = names
            return {name: getattr(value, name) for name in names}
        if is_pydantic_model(value):
            return model_value(value, path, self._encode_decimal)
        raise refuse(path, f"{type_name(value)} is not JSON serializable")

    def _convert_shallow(self, value: Any, path: str) -> Any:
        """``_convert`` for the NaN check: a converted model has been checked already."""
        return None if is_pydantic_model(value) else self._convert(value, path)

    def _encode_decimal(self, value: Decimal, path: str) -> Any:
        if not value.is_finite():
            raise non_finite(value, path)
        if not self._decimal_as_number:
            return str(value)
        return orjson.Fragment(str(value))  # Decimal's str is a valid JSON number when finite


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
