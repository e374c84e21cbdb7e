"""The OpenAPI 3 document of API v1, generated from the request and answer models.

Paths and operations are listed here; every body schema comes from a pydantic model
(``qmq_broker.http.schemas`` for requests, ``qmq_broker.http.answers`` for answers). The document
is as strict as the broker: each operation lists every status it can answer, with the error
codes each status carries (``qmq_wire.ERROR_STATUS``) and the headers that come with them,
and a request it allows is never refused with a 400 (``tests/acceptance/test_schemathesis.py``
holds a real broker to that). With auth on, the API's operations require the bearer token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

import qmq_wire as wire
from qmq_broker.console import answers as console_answers
from qmq_broker.http import answers
from qmq_broker.http.schemas import (
    REQUEST_MODELS,
    AckRequest,
    DeclareRequest,
    MergeRequest,
    MoveRequest,
    NackRequest,
    ProduceRequest,
    PullRequest,
    RedriveRequest,
    ResetRequest,
    SplitRequest,
)
from qmq_wire.records import RECORDS_MEDIA_TYPE

_REF = "#/components/schemas/{model}"
MAX_SCHEDULE_HOURS = 20_000
"""Largest ``limit`` of ``GET /v1/schedule`` (``qmq_broker.http.app`` enforces it)."""
DEFAULT_SCHEDULE_HOURS = 48

_DESCRIPTIONS = {
    400: "Invalid request: the error names the field",
    401: "No bearer token, or an unknown one",
    403: "The token lacks the right, or the Host or Origin header is not allowed",
    404: "Unknown subject, group or broadcast consumer",
    409: (
        "The request contradicts existing state: the group's mode, the subject being "
        "ordered or not, its route table"
    ),
    413: "Request or message body too large",
    415: "A POST body must be sent as Content-Type: application/json",
    429: "The group's mailbox of pending pulls is full; retry after Retry-After seconds",
    503: "Not now: recovering, shutting down, read-only or overloaded",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"required": True, "schema": {"type": "string", "const": "Bearer"}}},
    429: {
        "Retry-After": {
            "required": True,
            "schema": {"type": "string", "pattern": "^[0-9]+$"},
            "description": "seconds",
        }
    },
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Operation:
    """One route: what it takes, what it answers, and the error statuses it can give."""

    summary: str
    answer: type[BaseModel] | dict[str, Any]
    request: type[BaseModel] | None = None
    params: tuple[dict[str, Any], ...] = ()
    errors: tuple[int, ...] = ()
    api: bool = True
    """Part of API v1: behind auth (when on) and the broker's lifecycle check (503)."""
    records: bool = False
    """The 200 answer also comes as records, to a client that accepts them."""


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _statuses(operation: _Operation, *, auth: bool) -> list[int]:
    statuses = {403, *operation.errors}  # 403: a Host or Origin the broker does not serve
    if operation.request is not None:
        statuses |= {400, 413, 415}
    if operation.api:
        statuses.add(503)
        if auth:
            statuses.add(401)
    return sorted(statuses)


def _op(operation: _Operation, *, auth: bool) -> dict[str, Any]:
    answer = operation.answer
    content = _json(answer if isinstance(answer, dict) else _ref(answer))
    if operation.records:  # docs/architecture.md 3.1, "Pull answers as records"
        content[RECORDS_MEDIA_TYPE] = {"schema": {"type": "string", "format": "binary"}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status in _statuses(operation, auth=auth):
        response: dict[str, Any] = {
            "description": _DESCRIPTIONS[status],
            "content": _json({"$ref": _REF.format(model=f"Error{status}")}),
        }
        if status in _HEADERS:
            response["headers"] = _HEADERS[status]
        responses[str(status)] = response
    op: dict[str, Any] = {"summary": operation.summary, "responses": responses}
    if operation.request is not None:
        op["requestBody"] = {"required": True, "content": _json(_ref(operation.request))}
    if operation.params:
        op["parameters"] = list(operation.params)
    if auth:
        op["security"] = [{"bearer": []}] if operation.api else []
    return op


def _path_param(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": wire.NAME_PATTERN},
    }


def _query_param(name: str, *, low: int, high: int, default: int | None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": high}
    if default is not None:
        schema["default"] = default
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": "ASCII digits, given once",
        "schema": schema,
    }


def _error_schema(status: int) -> dict[str, Any]:
    """The error answer of one status: its ``code`` is one of that status's codes."""
    codes = sorted(code for code, known in wire.ERROR_STATUS.items() if known == status)
    code: dict[str, Any] = {"type": "string", "enum": codes}
    if status == 400:  # request validation names the field: invalid_<field>
        code = {"type": "string", "anyOf": [{"enum": codes}, {"pattern": "^invalid_[a-z_]+$"}]}
    return {
        "allOf": [
            _ref(answers.ErrorResponse),
            {"properties": {"error": {"properties": {"code": code}}}},
        ]
    }


def _components() -> dict[str, Any]:
    modes: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        *((model, "validation") for model in REQUEST_MODELS),
        *((model, "serialization") for model in answers.ANSWERS),
        *((model, "serialization") for model in console_answers.ANSWERS),
    ]
    _, schema = models_json_schema(modes, ref_template=_REF)
    components = dict(schema.get("$defs", {}))
    # The names the hand-written document used, kept for clients that refer to them.
    components["Error"] = _ref(answers.ErrorResponse)
    components["Message"] = _ref(answers.DeliveredMessage)
    for status in _DESCRIPTIONS:
        components[f"Error{status}"] = _error_schema(status)
    return components


def _operations() -> dict[str, dict[str, _Operation]]:
    subject_group = (_path_param("subject"), _path_param("group"))
    return {
        "/v1/messages": {
            "post": _Operation(
                summary="Produce a batch of messages",
                request=ProduceRequest,
                answer=answers.ProduceResponse,
                errors=(409,),
            )
        },
        "/v1/pull": {
            "post": _Operation(
                summary="Lease messages for a consumer (long poll)",
                request=PullRequest,
                answer=answers.PullResponse,
                errors=(404, 409, 429),
                records=True,
            )
        },
        "/v1/ack": {
            "post": _Operation(
                summary="Acknowledge leased messages",
                request=AckRequest,
                answer=answers.AckResponse,
                errors=(404, 409),
            )
        },
        "/v1/nack": {
            "post": _Operation(
                summary="Reject leased messages for retry",
                request=NackRequest,
                answer=answers.NackResponse,
                errors=(404, 409),
            )
        },
        "/v1/subjects": {
            "get": _Operation(summary="List subjects", answer=answers.SubjectsResponse)
        },
        "/v1/subjects/{subject}": {
            "get": _Operation(
                summary="Subject stats with its groups",
                answer=answers.SubjectResponse,
                params=(_path_param("subject"),),
                errors=(400, 404),
            ),
            "put": _Operation(
                summary="Declare an ordered subject (the same declaration again answers alike)",
                request=DeclareRequest,
                answer=answers.RoutesResponse,
                params=(_path_param("subject"),),
                errors=(409,),
            ),
        },
        "/v1/subjects/{subject}/routes": {
            "get": _Operation(
                summary="An ordered subject's route table, its history and its groups' versions",
                answer=answers.RoutesResponse,
                params=(_path_param("subject"),),
                errors=(400, 404, 409),
            )
        },
        **{
            f"/v1/subjects/{{subject}}/partitions/{change}": {
                "post": _Operation(
                    summary=summary,
                    request=model,
                    answer=answers.RoutesResponse,
                    params=(_path_param("subject"),),
                    errors=(404, 409),
                )
            }
            for change, model, summary in (
                ("split", SplitRequest, "Split a partition's range over two new partitions"),
                ("merge", MergeRequest, "Merge two partitions of adjacent ranges into a new one"),
                ("move", MoveRequest, "Move a partition's range to a new partition"),
            )
        },
        "/v1/subjects/{subject}/groups/{group}/dead": {
            "get": _Operation(
                summary="Dead letters of a group",
                answer=answers.DeadLettersResponse,
                params=(
                    *subject_group,
                    _query_param(
                        "limit",
                        low=1,
                        high=wire.MAX_DEAD_PAGE,
                        default=wire.DEFAULT_DEAD_PAGE,
                    ),
                    _query_param("after_seq", low=0, high=wire.MAX_SEQ, default=None),
                    _query_param("partition", low=0, high=wire.MAX_PARTITION_NUMBER, default=None),
                ),
                errors=(400, 404, 409),
            )
        },
        "/v1/subjects/{subject}/groups/{group}/dead/redrive": {
            "post": _Operation(
                summary="Put dead letters back for delivery",
                request=RedriveRequest,
                answer=answers.RedriveResponse,
                params=subject_group,
                errors=(404, 409),
            )
        },
        "/v1/subjects/{subject}/groups/{group}/reset": {
            "post": _Operation(
                summary=(
                    "Move a group to a position (replay from a seq or a time, or skip ahead); "
                    "409 group_busy while it has messages leased out, unless force"
                ),
                request=ResetRequest,
                answer=answers.ResetResponse,
                params=subject_group,
                errors=(400, 404, 409),
            )
        },
        "/v1/schedule": {
            "get": _Operation(
                summary=(
                    "Delayed messages not yet due: totals, per-hour counts (earliest first, "
                    "up to limit), next due time and dispatch lag"
                ),
                answer=answers.ScheduleResponse,
                params=(
                    _query_param(
                        "limit", low=1, high=MAX_SCHEDULE_HOURS, default=DEFAULT_SCHEDULE_HOURS
                    ),
                ),
                errors=(400,),
            )
        },
        "/v1/console/overview": {
            "get": _Operation(
                summary=(
                    "The console's overview: subjects the token sees with rates, backlog and "
                    "oldest unacked age; broker health, disk use, fsync latency"
                ),
                answer=console_answers.ConsoleOverview,
            )
        },
        "/v1/console/subjects/{subject}": {
            "get": _Operation(
                summary=(
                    "The console's view of a subject: consumers seen lately, oldest unacked "
                    "age per group, the sampled history, ordered partitions' owners"
                ),
                answer=console_answers.ConsoleSubject,
                params=(_path_param("subject"),),
                errors=(400, 404),
            )
        },
        "/healthz": {
            "get": _Operation(
                summary="Ready once recovery finished (503 before)",
                answer=answers.HealthResponse,
                api=False,
            )
        },
        "/openapi.json": {
            "get": _Operation(summary="This document", answer={"type": "object"}, api=False)
        },
    }


def _metrics(*, auth: bool) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": "Prometheus metrics",
        "responses": {
            "200": {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            "403": {
                "description": _DESCRIPTIONS[403],
                "content": _json({"$ref": _REF.format(model="Error403")}),
            },
        },
    }
    if auth:
        op["security"] = []
    return op


@functools.cache
def openapi_document(*, auth: bool = False) -> dict[str, Any]:
    """The document of a broker with auth on or off (with it on, API v1 needs a token)."""
    paths: dict[str, Any] = {
        path: {method: _op(operation, auth=auth) for method, operation in methods.items()}
        for path, methods in _operations().items()
    }
    paths["/metrics"] = {"get": _metrics(auth=auth)}
    # /healthz answers 503 with its own body while the broker recovers.
    paths["/healthz"]["get"]["responses"]["503"] = {
        "description": "Not ready: the body names the broker status",
        "content": _json(_ref(answers.HealthResponse)),
    }
    components: dict[str, Any] = {"schemas": _components()}
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "qmq broker", "version": "1"},
        "paths": paths,
        "components": components,
    }
