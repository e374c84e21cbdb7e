"""What the default JSON serializer puts on the wire, and what it refuses (issue 36 item 2).

ORM-mapped objects are refused whatever they also are, pydantic models keep their own
JSON rules (secrets, excluded fields), NaN and infinities are refused, every refusal names
the path inside the body, and every datetime comes out in one form (UTC, ``Z``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import orjson
import pydantic
import pytest
import sqlalchemy as sa
import sqlmodel
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    MappedAsDataclass,
    mapped_column,
    registry,
)

from qmq_outbox.errors import SerializationError
from qmq_outbox.serializers import JsonSerializer, serialize

HASH = "$argon2id$v=19$m=65536,t=3,p=4$c2FsdA$aGFzaA"


class Base(DeclarativeBase):
    pass


class DeclarativeUser(Base):
    __tablename__ = "wire_declarative_user"
    id: Mapped[int] = mapped_column(primary_key=True)
    hashed_password: Mapped[str] = mapped_column(sa.String(200))


class DataclassBase(MappedAsDataclass, DeclarativeBase):
    pass


class DataclassUser(DataclassBase):
    __tablename__ = "wire_dataclass_user"
    id: Mapped[int] = mapped_column(primary_key=True)
    hashed_password: Mapped[str] = mapped_column(sa.String(200))


class ImperativeUser:
    def __init__(self, id: int, hashed_password: str) -> None:
        self.id = id
        self.hashed_password = hashed_password


_imperative = registry()
_imperative.map_imperatively(
    ImperativeUser,
    sa.Table(
        "wire_imperative_user",
        _imperative.metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hashed_password", sa.String(200)),
    ),
)


class UserBase(sqlmodel.SQLModel):
    email: str


class TableUser(UserBase, table=True):
    __tablename__ = "wire_sqlmodel_user"
    id: int | None = sqlmodel.Field(default=None, primary_key=True)
    hashed_password: str


class UserCreated(UserBase):  # a SQLModel without table=True: a plain pydantic model
    id: int


class Account(pydantic.BaseModel):
    name: str
    token: pydantic.SecretStr
    internal_note: str = pydantic.Field(default="", exclude=True)


class Stamped(pydantic.BaseModel):
    naive: datetime
    aware: datetime
    shifted: datetime
    amount: Decimal


class Loose(pydantic.BaseModel):
    extra: dict[str, Any]


class CustomStamp(pydantic.BaseModel):
    at: datetime

    @pydantic.field_serializer("at", when_used="json")
    def _epoch(self, value: datetime) -> str:
        return f"epoch:{int(value.timestamp())}"


class Price(pydantic.BaseModel):
    amount: float


@dataclasses.dataclass
class Item:
    sku: str
    price: Any


class Weight(enum.Enum):
    UNKNOWN = math.nan


def dumps(value: Any, **kwargs: Any) -> Any:
    return orjson.loads(JsonSerializer(**kwargs).dumps(value))


def refusal(value: Any) -> str:
    with pytest.raises(SerializationError) as caught:
        JsonSerializer().dumps(value)
    return str(caught.value)


# -- ORM objects -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "user",
    [
        DeclarativeUser(id=1, hashed_password=HASH),
        DataclassUser(id=1, hashed_password=HASH),
        ImperativeUser(id=1, hashed_password=HASH),
        TableUser(id=1, email="a@example.com", hashed_password=HASH),
    ],
    ids=["declarative", "mapped-dataclass", "imperative", "sqlmodel-table"],
)
def test_orm_mapped_instances_are_refused_naming_their_type(user: object) -> None:
    for value, path in [(user, "body"), ({"user": user}, "body.user"), ([1, user], "body[1]")]:
        with pytest.raises(SerializationError) as caught:
            serialize(value, JsonSerializer())
        text = str(caught.value)
        assert text.startswith(f"{path}: ")
        assert type(user).__qualname__ in text
        assert "ORM-mapped" in text
        assert "pydantic model (not a table model)" in text
        assert HASH not in text


def test_a_sqlmodel_without_table_is_a_pydantic_model_and_published() -> None:
    user = TableUser(id=7, email="a@example.com", hashed_password=HASH)
    event = UserCreated.model_validate(user, from_attributes=True)
    assert dumps(event) == {"email": "a@example.com", "id": 7}
    assert dumps({"event": event}) == {"event": {"email": "a@example.com", "id": 7}}


def test_pydantic_models_keep_secrets_and_excluded_fields_out() -> None:
    account = Account(name="ada", token=pydantic.SecretStr("s3cret"), internal_note="vip")
    assert dumps(account) == {"name": "ada", "token": "**********"}
    assert dumps([{"account": account}]) == [{"account": {"name": "ada", "token": "**********"}}]


# -- NaN and infinities --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (math.nan, "body"),
        ({"price": math.inf}, "body.price"),
        ({"items": [1.0, 2.0, 3.0, {"price": -math.inf}]}, "body.items[3].price"),
        ({"items": [Item(sku="a", price=math.nan)]}, "body.items[0].price"),
        ({"weight": Weight.UNKNOWN}, "body.weight"),
        ({"p": [Price(amount=math.nan)]}, "body.p[0].amount"),
        ({"d": Decimal("NaN")}, "body.d"),
        ({"d": [Decimal("-Infinity")]}, "body.d[0]"),
        ({"m": Loose(extra={"d": Decimal("sNaN")})}, "body.m.extra.d"),
    ],
)
def test_nan_and_infinities_are_refused_with_their_path(value: Any, path: str) -> None:
    text = refusal(value)
    assert text.startswith(f"{path}: ")
    assert "NaN and infinities are refused" in text


def test_none_and_the_text_null_are_not_mistaken_for_nan() -> None:
    value = {"a": None, "b": [None, 1.5, "null"], "c": Item(sku="null", price=None)}
    assert dumps(value) == {
        "a": None,
        "b": [None, 1.5, "null"],
        "c": {"sku": "null", "price": None},
    }


# -- paths of other refusals ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"items": [{}, {}, {}, {"price": {1, 2}}]}, "body.items[3].price: set is not JSON"),
        ({"order id": {"at": timedelta(1)}}, 'body["order id"].at: datetime.timedelta is not'),
        ({"line": Item(sku="a", price=object())}, "body.line.price: object is not JSON"),
        ({"q": [2**64]}, "body.q[0]: 18446744073709551616 does not fit in 64 bits"),
        ({"s": "\ud800"}, "body.s: a str that is not valid UTF-8"),
        ({"nested": {3: "x"}}, "body.nested: key 3 (int) is not a str"),
    ],
)
def test_refusals_name_the_path_inside_the_body(value: Any, expected: str) -> None:
    assert expected in refusal(value)


def test_a_reference_cycle_is_refused_not_a_recursion_error() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    assert "nested deeper than 254 levels" in refusal(loop)


# -- one datetime form -----------------------------------------------------------------------


def test_every_datetime_source_gives_the_same_rfc3339_utc_form() -> None:
    instant = "2024-05-06T07:08:09.123456Z"
    naive = datetime(2024, 5, 6, 7, 8, 9, 123456)  # taken as UTC
    aware = naive.replace(tzinfo=UTC)
    shifted = aware.astimezone(timezone(timedelta(hours=2)))
    model = Stamped(naive=naive, aware=aware, shifted=shifted, amount=Decimal("1.10"))
    assert dumps([naive, aware, shifted]) == [instant] * 3
    assert dumps(Item(sku="a", price=shifted)) == {"sku": "a", "price": instant}
    assert dumps(model) == {
        "naive": instant,
        "aware": instant,
        "shifted": instant,
        "amount": "1.10",
    }
    whole = "2024-05-06T07:08:09Z"
    assert dumps(naive.replace(microsecond=0)) == whole  # no fraction when there is none
    assert dumps(model.model_copy(update={"aware": aware.replace(microsecond=0)}))["aware"] == whole
    assert dumps({"day": date(2024, 5, 6)}) == {"day": "2024-05-06"}


def test_decimal_rule_applies_inside_models_and_a_models_own_serializer_wins() -> None:
    model = Stamped(
        naive=datetime(2024, 1, 1),
        aware=datetime(2024, 1, 1, tzinfo=UTC),
        shifted=datetime(2024, 1, 1, tzinfo=UTC),
        amount=Decimal("12.30"),
    )
    assert JsonSerializer(decimal="number").dumps(model).endswith(b'"amount":12.30}')
    at = datetime(2024, 1, 1, tzinfo=UTC)
    assert dumps(CustomStamp(at=at)) == {"at": f"epoch:{int(at.timestamp())}"}
