"""Error answers: ``{"error": {"code", "message", "field"}}`` naming the offending field."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError
from starlette.responses import Response

import qmq_wire
from qmq_broker.errors import Invalid, RequestError
from qmq_broker.http.schemas import REQUEST_MODELS

_FIELD_NAMES = frozenset(name for model in REQUEST_MODELS for name in model.model_fields)


def error_response(error: RequestError) -> Response:
    """The answer to a core error: its status follows from its code (``qmq_wire``)."""
    body = {"error": {"code": error.code, "message": error.message, "field": error.field}}
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if error.code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    return Response(
        orjson.dumps(body),
        status_code=qmq_wire.error_status(error.code),
        media_type="application/json",
        headers=headers,
    )


def internal_error_response() -> Response:
    """The 500 of an unexpected exception: no detail leaves the broker, the log has it."""
    return error_response(
        RequestError(code="internal", message="internal error; see the broker log")
    )


def field_path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 3, "subject")`` -> ``messages[3].subject``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]":
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def from_validation(exc: ValidationError) -> RequestError:
    first: Any = exc.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    kind = first["type"]
    field = field_path(loc) or None
    if kind == "json_invalid":
        return Invalid(
            code="invalid_json",
            message=f"request body is not valid JSON: {first['msg']}",
        )
    if kind in ("model_type", "model_attributes_type") and not loc:
        return Invalid(code="invalid_body", message="request body must be a JSON object")
    if kind == "missing":
        code = "missing_field"
    elif kind == "extra_forbidden":
        code = "unknown_field"
    else:
        names = [p for p in loc if isinstance(p, str) and p in _FIELD_NAMES]
        code = f"invalid_{names[-1]}" if names else "invalid_request"
    return Invalid(code=code, message=f"{field or 'body'}: {first['msg']}", field=field)
