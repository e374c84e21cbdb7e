"""What a request names in its path and query, checked: subject and group names, integer
parameters; and whether the caller may see the subject it names."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

import qmq_wire
from qmq_broker.errors import Denied, Invalid
from qmq_broker.http.auth import Grant


def path_name(request: Request, name: str) -> str:
    """A subject or group name from the path, checked against the naming rules."""
    value = str(request.path_params[name])
    if not qmq_wire.valid_name(value):
        raise Invalid(
            code=f"invalid_{name}",
            message=f"{name} does not match the naming rules",
            field=name,
        )
    return value


def int_param(request: Request, name: str, *, default: int | None, low: int = 1, high: int) -> Any:
    """A query parameter of ASCII digits within ``[low, high]`` (``str.isdigit`` alone would
    take ``²``); given twice, or with anything else, it is a 400 naming it."""
    values = request.query_params.getlist(name)
    if not values:
        return default
    raw = values[0]
    if (
        len(values) > 1
        or not raw.isascii()
        or not raw.isdigit()
        or len(raw) > 19
        or not low <= int(raw) <= high
    ):
        raise Invalid(
            code=f"invalid_{name}",
            message=f"{name} must be one integer in [{low}, {high}]",
            field=name,
        )
    return int(raw)


def require_sight(grant: Grant | None, subject: str) -> None:
    """A subject's details are shown to a token with any right on it."""
    if grant is not None and not grant.sees(subject):
        raise Denied(
            code="forbidden",
            message=f"token {grant.name!r} has no right on {subject!r}",
            field="subject",
        )
