"""The in-memory broker's HTTP side: its routes, reading a request, writing a JSON answer."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import httpx
import orjson

ROUTES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"/v1/messages"), "POST", "produce"),
    (re.compile(r"/v1/pull"), "POST", "pull"),
    (re.compile(r"/v1/ack"), "POST", "ack"),
    (re.compile(r"/v1/nack"), "POST", "nack"),
    (re.compile(r"/v1/subjects"), "GET", "subjects"),
    (re.compile(r"/v1/subjects/([^/]+)"), "GET", "subject"),
    (re.compile(r"/v1/subjects/([^/]+)"), "PUT", "declare_subject"),
    (re.compile(r"/v1/subjects/([^/]+)/routes"), "GET", "routes"),
    (re.compile(r"/v1/subjects/([^/]+)/partitions/split"), "POST", "split_partition"),
    (re.compile(r"/v1/subjects/([^/]+)/partitions/merge"), "POST", "merge_partitions"),
    (re.compile(r"/v1/subjects/([^/]+)/partitions/move"), "POST", "move_partition"),
    (re.compile(r"/v1/subjects/([^/]+)/groups/([^/]+)/dead"), "GET", "dead_letters"),
    (re.compile(r"/v1/subjects/([^/]+)/groups/([^/]+)/dead/redrive"), "POST", "redrive"),
    (re.compile(r"/v1/subjects/([^/]+)/groups/([^/]+)/reset"), "POST", "reset_group"),
    (re.compile(r"/healthz"), "GET", "healthz"),
]
"""(path, method, operation), the operation named as the clients' method."""
OPERATIONS = tuple(name for _, _, name in ROUTES)


def operation(name: str) -> str:
    """``name`` if it is an operation (``ValueError`` otherwise)."""
    if name not in OPERATIONS:
        raise ValueError(f"unknown operation {name!r}; one of {', '.join(OPERATIONS)}")
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class Unreadable:
    """A POST body that is not JSON (answered 400 once the switches had their say)."""

    reason: str


def media_type(request: httpx.Request) -> str:
    value: str = request.headers.get("content-type", "")
    return value.partition(";")[0].strip().lower()


def read(request: httpx.Request) -> Any:
    """A POST's or PUT's JSON document, a GET's query parameters."""
    if request.method == "GET":
        return dict(request.url.params)
    try:
        return orjson.loads(request.content)
    except orjson.JSONDecodeError as exc:
        return Unreadable(str(exc))


def json_response(status: int, doc: Any) -> httpx.Response:
    return httpx.Response(
        status, content=orjson.dumps(doc), headers={"content-type": "application/json"}
    )
