"""Where in a message body the JSON serializer refuses a value, and why.

orjson stops at the first value it cannot write but does not say where it is. When it
fails (or may have written a NaN as ``null``), ``find_refusal`` walks the same value the
way orjson does and raises ``SerializationError`` naming the path (``body.items[3].price``).
Values orjson hands to the serializer's hook go through ``convert``, which refuses or
returns what to write instead; the walk goes on into that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import date, datetime, time
from enum import Enum
from typing import Any
from uuid import UUID

import orjson

from qmq_outbox.errors import SerializationError

ROOT = "body"
MAX_DEPTH = 254  # orjson's own nesting limit
_INT_RANGE = range(-(2**63), 2**64)
_LEAVES = frozenset({str, int, bool, type(None), datetime, date, time, UUID, orjson.Fragment})

# ``convert(value, path)``: what orjson's ``default=`` hook returns for ``value``.
Convert = Callable[[Any, str], Any]


def key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{orjson.dumps(key).decode()}]"


def type_name(value: object) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def refuse(path: str, reason: str) -> SerializationError:
    return SerializationError(f"{path}: {reason}")


def non_finite(value: object, path: str) -> SerializationError:
    return refuse(path, f"{value!r} is not a JSON number (NaN and infinities are refused)")


def find_refusal(value: Any, convert: Convert, *, str_keys: bool = True) -> None:
    """Raise ``SerializationError`` for the first value (depth first) that cannot be written."""
    _walk(value, ROOT, 0, convert, str_keys)


def has_non_finite(value: Any, convert: Convert) -> bool:
    """Whether a value orjson wrote holds a NaN or an infinity (it wrote them as ``null``).

    Without paths, on a stack: only a body that holds one pays for ``find_refusal``."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            items: Any = item.values()
        elif kind is list or kind is tuple:
            items = item
        elif isinstance(item, float):
            if not math.isfinite(item):
                return True
            continue
        elif isinstance(item, dict):
            items = item.values()
        elif isinstance(item, list | tuple):
            items = item
        elif isinstance(item, Enum):
            items = (item.value,)
        elif isinstance(item, str | int | date | time | UUID | orjson.Fragment | None):
            continue
        else:
            items = (convert(item, ROOT),)
        for child in items:  # leaves here, containers on the stack
            kind = type(child)
            if kind is float:
                if not math.isfinite(child):
                    return True
            elif kind not in _LEAVES:
                stack.append(child)
    return False


def _walk(value: Any, path: str, depth: int, convert: Convert, str_keys: bool) -> None:
    if depth > MAX_DEPTH:
        raise refuse(path, f"nested deeper than {MAX_DEPTH} levels (a reference cycle?)")
    if value is None or isinstance(value, bool | orjson.Fragment | UUID):
        return
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise refuse(path, "a str that is not valid UTF-8 (a lone surrogate)") from None
        return
    if isinstance(value, int):
        if value not in _INT_RANGE:
            raise refuse(path, f"{value} does not fit in 64 bits; publish it as a str")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise non_finite(value, path)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                if str_keys:
                    raise refuse(path, f"key {key!r} ({type_name(key)}) is not a str")
                key = str(key)
            _walk(item, key_path(path, key), depth + 1, convert, str_keys)
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]", depth + 1, convert, str_keys)
        return
    if isinstance(value, Enum):
        _walk(value.value, path, depth + 1, convert, str_keys)
        return
    if isinstance(value, time) and value.tzinfo is not None:
        raise refuse(path, "a time with a tzinfo; publish a datetime")
    if isinstance(value, date | time) and not isinstance(value, datetime):
        return
    _walk(convert(value, path), path, depth + 1, convert, str_keys)
