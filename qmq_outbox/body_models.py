"""ORM objects and pydantic models as message bodies, under the default JSON serializer.

An ORM-mapped instance is refused whatever else it is (a SQLModel table model is also a
pydantic model, a mapped dataclass a dataclass): it carries every column, secrets
included. A pydantic model is dumped in pydantic's JSON mode, so ``SecretStr``, ``exclude``
and JSON serializers keep working; where that dump shows pydantic's default text for a
datetime or a ``Decimal``, or a NaN, the SDK's rule for the type applies instead (a second,
Python-mode dump says which values those are).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from typing import Any

from qmq_outbox.body_paths import key_path, non_finite, refuse, type_name
from qmq_outbox.envelope import format_timestamp

EncodeDecimal = Callable[[Decimal, str], Any]
_ABSENT = object()
_PLAIN = frozenset({str, int, bool, type(None)})  # JSON-mode values the rules leave alone
_CLASS_MANAGER = "_sa_class_manager"  # sqlalchemy.orm.base.DEFAULT_MANAGER_ATTR


def is_orm_mapped(value: object) -> bool:
    """An instance of a class mapped by SQLAlchemy (declarative, imperative, mapped
    dataclass, SQLModel ``table=True``): SQLAlchemy instruments every such class with its
    class manager, which is what its own ``inspect()`` looks for."""
    return hasattr(type(value), _CLASS_MANAGER)


def orm_refusal(value: object, path: str) -> Exception:
    return refuse(
        path,
        f"{type_name(value)} is an ORM-mapped object, which would send every column it "
        "holds; publish a dict, a dataclass or a pydantic model (not a table model) of the "
        "fields the message is meant to carry",
    )


def is_pydantic_model(value: object) -> bool:
    return hasattr(type(value), "__pydantic_fields__") and callable(
        getattr(value, "model_dump", None)
    )


def model_value(model: Any, path: str, encode_decimal: EncodeDecimal) -> Any:
    """``model`` as JSON-ready values under the serializer's rules."""
    try:
        as_json = model.model_dump(mode="json")
        as_python = model.model_dump()
    except Exception as exc:  # pydantic's error names the type it cannot serialize
        raise refuse(path, f"{type_name(model)}: {exc}") from exc
    return _align(as_python, as_json, path, encode_decimal)


def _align(py: Any, js: Any, path: str, encode_decimal: EncodeDecimal) -> Any:
    if isinstance(js, dict):
        fields = py if isinstance(py, dict) else {}
        out = {}
        for key, item in js.items():
            own = fields.get(key, _ABSENT)
            if type(item) in _PLAIN and type(own) is type(item):  # nothing to change
                out[key] = item
            else:
                out[key] = _align(own, item, key_path(path, key), encode_decimal)
        return out
    if isinstance(js, list):
        items = py if isinstance(py, list | tuple) and len(py) == len(js) else [_ABSENT] * len(js)
        return [
            j
            if type(j) in _PLAIN and type(p) is type(j)
            else _align(p, j, f"{path}[{i}]", encode_decimal)
            for i, (p, j) in enumerate(zip(items, js, strict=True))
        ]
    if isinstance(js, float) and not math.isfinite(js):
        raise non_finite(js, path)
    if isinstance(py, float) and not math.isfinite(py) and not isinstance(js, str):
        raise non_finite(py, path)  # pydantic may have written it as null already
    if isinstance(py, datetime | Decimal) and js == _pydantic_text(py):
        # pydantic's own text for the type, not a serializer of the model's
        return format_timestamp(py) if isinstance(py, datetime) else encode_decimal(py, path)
    return js


def _pydantic_text(value: Any) -> Any:
    from pydantic_core import to_jsonable_python  # present whenever a model is

    return to_jsonable_python(value)
