"""The default JSON serializer's type mapping (the table in docs/outbox.md)."""

from __future__ import annotations

import dataclasses
import enum
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import orjson
import pydantic
import pytest

from qmq_outbox.errors import ConfigurationError, SerializationError
from qmq_outbox.serializers import OCTET_STREAM, JsonSerializer, serialize

ORDER_ID = uuid.UUID("0190f3a4-5b6c-7d8e-9fab-0123456789ab")


class Status(enum.Enum):
    PLACED = "placed"
    PAID = "paid"


class Priority(enum.IntEnum):
    HIGH = 1


class Rate(enum.Enum):
    STANDARD = Decimal("0.20")


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    price: Decimal
    added_at: datetime


class LineModel(pydantic.BaseModel):
    sku: str
    price: Decimal
    on: date


class OrderModel(pydantic.BaseModel):
    id: uuid.UUID
    status: Status
    lines: list[LineModel]


def dumps(value: Any, **kwargs: Any) -> Any:
    """Serialize with a default-configured serializer (or ``kwargs``) and parse back."""
    return orjson.loads(JsonSerializer(**kwargs).dumps(value))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (Decimal("12.30"), "12.30"),
        (Decimal("-0.000001"), "-0.000001"),
        (Decimal("1E+3"), "1E+3"),
        (ORDER_ID, "0190f3a4-5b6c-7d8e-9fab-0123456789ab"),
        (datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC), "2024-05-06T07:08:09.123456Z"),
        (
            datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone(timedelta(hours=2))),
            "2024-05-06T05:08:09Z",  # in UTC
        ),
        (datetime(2024, 5, 6, 7, 8, 9), "2024-05-06T07:08:09Z"),  # naive: taken as UTC
        (date(2024, 5, 6), "2024-05-06"),
        (time(7, 8, 9), "07:08:09"),
        (Status.PAID, "paid"),
        (Priority.HIGH, 1),
        (Rate.STANDARD, "0.20"),  # an Enum's value goes through the same mapping
        ((1, "a"), [1, "a"]),
    ],
)
def test_scalars(value: Any, expected: Any) -> None:
    assert dumps(value) == expected


def test_decimal_keeps_its_exact_digits_as_a_string_by_default() -> None:
    raw = JsonSerializer().dumps({"amount": Decimal("12345678901234567890.123456789")})
    assert raw == b'{"amount":"12345678901234567890.123456789"}'


def test_decimal_as_number_keeps_its_digits_in_the_json_text() -> None:
    serializer = JsonSerializer(decimal="number")
    raw = serializer.dumps({"amount": Decimal("12345678901234567890.10"), "e": Decimal("1E+3")})
    assert raw == b'{"amount":12345678901234567890.10,"e":1E+3}'
    assert orjson.loads(raw)["e"] == 1000.0
    with pytest.raises(SerializationError, match=r"Decimal\('Infinity'\)"):
        serializer.dumps([Decimal("Infinity")])


def test_dataclasses_and_pydantic_models_nested_in_lists_and_dicts() -> None:
    added = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    model = OrderModel(
        id=ORDER_ID,
        status=Status.PLACED,
        lines=[LineModel(sku="a", price=Decimal("1.50"), on=date(2024, 1, 2))],
    )
    body = {
        "lines": [Line(sku="a", price=Decimal("1.50"), added_at=added)],
        "model": model,
        "by_id": {"x": [model]},
    }
    expected_model = {
        "id": str(ORDER_ID),
        "status": "placed",
        "lines": [{"sku": "a", "price": "1.50", "on": "2024-01-02"}],
    }
    assert dumps(body) == {
        "lines": [{"sku": "a", "price": "1.50", "added_at": "2024-01-02T03:04:05Z"}],
        "model": expected_model,
        "by_id": {"x": [expected_model]},
    }


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({"nested": [object()]}, "object"),
        ({1, 2}, "set"),
        (timedelta(seconds=1), "datetime.timedelta"),
        ({"model_class": OrderModel}, r"\.ModelMetaclass"),  # a model class, not a model
        ([Status], "enum.EnumType"),
    ],
)
def test_anything_else_is_refused_naming_its_type(value: Any, type_name: str) -> None:
    with pytest.raises(SerializationError, match=f"{type_name} is not JSON serializable"):
        JsonSerializer().dumps(value)
    with pytest.raises(SerializationError, match=type_name):
        serialize(value, JsonSerializer())


def test_non_string_keys_are_refused() -> None:
    with pytest.raises(SerializationError, match="key"):
        JsonSerializer().dumps({1: "a"})


def test_extra_orjson_options_keep_the_defaults() -> None:
    serializer = JsonSerializer(option=orjson.OPT_SORT_KEYS)
    assert serializer.dumps({"b": datetime(2024, 1, 1), "a": Decimal("1.0")}) == (
        b'{"a":"1.0","b":"2024-01-01T00:00:00Z"}'
    )


def test_bytes_pass_through_unchanged() -> None:
    assert serialize(b"\x00raw", JsonSerializer()) == (b"\x00raw", OCTET_STREAM)
    assert serialize({"a": 1}, JsonSerializer()) == (b'{"a":1}', "application/json")


def test_decimal_format_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="decimal"):
        JsonSerializer(decimal="float")  # type: ignore[arg-type]
