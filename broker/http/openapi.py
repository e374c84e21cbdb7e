"""The OpenAPI 3 document of API v1, generated from the request and answer models.

Paths and operations are listed here; every schema comes from a pydantic model
(``broker.http.schemas`` for requests, ``broker.http.answers`` for answers).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from broker.http import answers
from broker.http.schemas import AckRequest, NackRequest, ProduceRequest, PullRequest, RedriveRequest

_REF = "#/components/schemas/{model}"
_REQUESTS: tuple[type[BaseModel], ...] = (
    ProduceRequest,
    PullRequest,
    AckRequest,
    NackRequest,
    RedriveRequest,
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _op(
    summary: str,
    request: type[BaseModel] | None,
    answer: type[BaseModel] | dict[str, Any],
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    schema = answer if isinstance(answer, dict) else _ref(answer)
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
            "default": {
                "description": "Error",
                "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}},
            },
        },
    }
    if request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        }
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _query_param(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 0},
    }


def _components() -> dict[str, Any]:
    modes: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        *((model, "validation") for model in _REQUESTS),
        *((model, "serialization") for model in answers.ANSWERS),
    ]
    _, schema = models_json_schema(modes, ref_template=_REF)
    components = dict(schema.get("$defs", {}))
    # The names the hand-written document used, kept for clients that refer to them.
    components["Error"] = _ref(answers.ErrorResponse)
    components["Message"] = _ref(answers.DeliveredMessage)
    return components


@functools.cache
def openapi_document() -> dict[str, Any]:
    subject_group = [_path_param("subject"), _path_param("group")]
    return {
        "openapi": "3.1.0",
        "info": {"title": "qmq broker", "version": "1"},
        "paths": {
            "/v1/messages": {
                "post": _op("Produce a batch of messages", ProduceRequest, answers.ProduceResponse)
            },
            "/v1/pull": {
                "post": _op(
                    "Lease messages for a consumer (long poll)", PullRequest, answers.PullResponse
                )
            },
            "/v1/ack": {
                "post": _op("Acknowledge leased messages", AckRequest, answers.AckResponse)
            },
            "/v1/nack": {
                "post": _op("Reject leased messages for retry", NackRequest, answers.NackResponse)
            },
            "/v1/subjects": {"get": _op("List subjects", None, answers.SubjectsResponse)},
            "/v1/subjects/{subject}": {
                "get": _op(
                    "Subject stats with its groups",
                    None,
                    answers.SubjectResponse,
                    [_path_param("subject")],
                )
            },
            "/v1/subjects/{subject}/groups/{group}/dead": {
                "get": _op(
                    "Dead letters of a group",
                    None,
                    answers.DeadLettersResponse,
                    [*subject_group, _query_param("limit"), _query_param("after_seq")],
                )
            },
            "/v1/subjects/{subject}/groups/{group}/dead/redrive": {
                "post": _op(
                    "Put dead letters back for delivery",
                    RedriveRequest,
                    answers.RedriveResponse,
                    subject_group,
                )
            },
            "/v1/schedule": {
                "get": _op(
                    "Delayed messages not yet due: totals, per-hour counts (earliest first, "
                    "up to limit), next due time and dispatch lag",
                    None,
                    answers.ScheduleResponse,
                    [_query_param("limit")],
                )
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "text format"}},
                }
            },
            "/healthz": {
                "get": _op(
                    "Ready once recovery finished (503 before)", None, answers.HealthResponse
                )
            },
            "/openapi.json": {"get": _op("This document", None, {"type": "object"})},
        },
        "components": {
            "schemas": _components(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
