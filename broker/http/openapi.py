"""The OpenAPI 3 document of API v1, built from the request models' JSON schemas."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from broker.http.schemas import AckRequest, NackRequest, ProduceRequest, PullRequest, RedriveRequest

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field": {"type": ["string", "null"]},
            },
            "required": ["code", "message", "field"],
        }
    },
}

_MESSAGE = {
    "type": "object",
    "properties": {
        name: {"type": kind}
        for name, kind in [
            ("id", "string"),
            ("subject", "string"),
            ("seq", "integer"),
            ("attempt", "integer"),
            ("key", ["string", "null"]),
            ("headers", "object"),
            ("body", "string"),
            ("body_encoding", "string"),
            ("producer", ["string", "null"]),
            ("created_at", "string"),
            ("stored_at", "string"),
        ]
    },
}


_SCHEDULE = {
    "type": "object",
    "properties": {
        "messages": {"type": "integer"},
        "bytes": {"type": "integer"},
        "next_due_at": {"type": ["string", "null"]},
        "dispatch_lag_ms": {"type": "number"},
        "wheel_messages": {"type": "integer"},
        "dispatched": {"type": "integer"},
        "last_dispatch": {
            "type": ["object", "null"],
            "properties": {"at": {"type": "string"}, "lateness_ms": {"type": "number"}},
        },
        "hours": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "hour": {"type": "string"},
                    "messages": {"type": "integer"},
                    "bytes": {"type": "integer"},
                    "loaded": {"type": "boolean"},
                },
            },
        },
        "more_hours": {"type": "boolean"},
    },
}


def _op(
    summary: str,
    request: str | None,
    response: dict[str, Any],
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": response}}},
            "default": {
                "description": "Error",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        },
    }
    if request:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=request)}}},
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


@functools.cache
def openapi_document() -> dict[str, Any]:
    models: list[type[BaseModel]] = [
        ProduceRequest,
        PullRequest,
        AckRequest,
        NackRequest,
        RedriveRequest,
    ]
    _, schema = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = dict(schema.get("$defs", {}))
    components["Error"] = _ERROR
    components["Message"] = _MESSAGE
    obj = {"type": "object"}
    subject_group = [_path_param("subject"), _path_param("group")]
    return {
        "openapi": "3.1.0",
        "info": {"title": "qmq broker", "version": "1"},
        "paths": {
            "/v1/messages": {
                "post": _op(
                    "Produce a batch of messages",
                    "ProduceRequest",
                    {
                        "type": "object",
                        "properties": {
                            "results": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "id": {"type": "string"},
                                        "subject": {"type": "string"},
                                        "status": {"enum": ["stored", "duplicate", "scheduled"]},
                                        "seq": {
                                            "type": ["integer", "null"],
                                            "description": (
                                                "null when scheduled (deliver_at in the future: "
                                                "the seq is assigned when it is due) and for a "
                                                "duplicate of a message still scheduled"
                                            ),
                                        },
                                    },
                                },
                            }
                        },
                    },
                )
            },
            "/v1/pull": {
                "post": _op(
                    "Lease messages for a consumer (long poll)",
                    "PullRequest",
                    {
                        "type": "object",
                        "properties": {
                            "messages": {
                                "type": "array",
                                "items": {"$ref": "#/components/schemas/Message"},
                            }
                        },
                    },
                )
            },
            "/v1/ack": {
                "post": _op(
                    "Acknowledge leased messages",
                    "AckRequest",
                    {
                        "type": "object",
                        "properties": {
                            "acked": {"type": "integer"},
                            "unknown": {"type": "array", "items": {"type": "integer"}},
                        },
                    },
                )
            },
            "/v1/nack": {
                "post": _op(
                    "Reject leased messages for retry",
                    "NackRequest",
                    {
                        "type": "object",
                        "properties": {
                            "retrying": {"type": "integer"},
                            "dead": {"type": "integer"},
                        },
                    },
                )
            },
            "/v1/subjects": {"get": _op("List subjects", None, obj)},
            "/v1/subjects/{subject}": {
                "get": _op("Subject stats with its groups", None, obj, [_path_param("subject")])
            },
            "/v1/subjects/{subject}/groups/{group}/dead": {
                "get": _op(
                    "Dead letters of a group",
                    None,
                    obj,
                    [*subject_group, _query_param("limit"), _query_param("after_seq")],
                )
            },
            "/v1/subjects/{subject}/groups/{group}/dead/redrive": {
                "post": _op(
                    "Put dead letters back for delivery",
                    "RedriveRequest",
                    {"type": "object", "properties": {"redriven": {"type": "integer"}}},
                    subject_group,
                )
            },
            "/v1/schedule": {
                "get": _op(
                    "Delayed messages not yet due: totals, per-hour counts (earliest first, "
                    "up to limit), next due time and dispatch lag",
                    None,
                    _SCHEDULE,
                    [_query_param("limit")],
                )
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "text format"}},
                }
            },
            "/healthz": {"get": _op("Ready once recovery finished (503 before)", None, obj)},
            "/openapi.json": {"get": _op("This document", None, obj)},
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
