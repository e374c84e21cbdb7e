"""Routes of API v1 over the broker's services: size limits, validation, auth, JSON."""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import qmq_wire
from broker.engine import Broker
from broker.errors import Invalid, NotFound, RequestError
from broker.http.auth import Authorizer
from broker.http.errors import error_response, from_validation
from broker.http.openapi import openapi_document
from broker.http.schemas import (
    AckRequest,
    Envelope,
    NackRequest,
    ProduceRequest,
    PullRequest,
    RedriveRequest,
)
from broker.messages import IncomingMessage

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request], Awaitable[Response]]
_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def _micros(value: datetime) -> int:
    return int(value.astimezone(UTC).timestamp() * 1_000_000)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _exact_micros(value: datetime) -> int:
    """Microseconds since the epoch without float rounding (due times must not move early)."""
    return (value - _EPOCH) // timedelta(microseconds=1)


def _span(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:g} days" if days >= 1 else f"{seconds:g} s"


class Api:
    """Binds HTTP requests to a ``Broker``: size limits, validation, auth, error mapping."""

    def __init__(self, broker: Broker, *, authorizer: Authorizer | None = None) -> None:
        self.broker = broker
        self.authorizer = authorizer

    async def _body(self, request: Request) -> bytes:
        limit = self.broker.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Invalid(code="request_too_large", message=f"request body over {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Invalid(code="request_too_large", message=f"request body over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, request: Request, model: type[M]) -> M:
        raw = await self._body(request)
        adapter = _ADAPTERS.get(model)
        if adapter is None:
            adapter = _ADAPTERS[model] = TypeAdapter(model)
        try:
            parsed: M = adapter.validate_json(raw)
        except ValidationError as exc:
            raise from_validation(exc) from None
        return parsed

    def _authorize(self, request: Request, right: str, subject: str, field: str) -> None:
        if self.authorizer is not None:
            self.authorizer.check(request.headers.get("authorization"), right, subject, field)

    # --- endpoints ------------------------------------------------------------------------

    async def produce(self, request: Request) -> Response:
        parsed = await self._parse(request, ProduceRequest)
        for i, envelope in enumerate(parsed.messages):
            self._authorize(request, "produce", envelope.subject, f"messages[{i}].subject")
        now_us = self.broker.clock.wall_us()
        messages = [self._incoming(i, e, now_us) for i, e in enumerate(parsed.messages)]
        results = await self.broker.producer.produce(messages)
        return _json({"results": results})

    def _incoming(self, index: int, envelope: Envelope, now_us: int) -> IncomingMessage:
        field = f"messages[{index}]"
        if envelope.body_encoding == "base64":
            try:
                body = base64.b64decode(envelope.body, validate=True)
            except (binascii.Error, ValueError):
                raise Invalid(
                    code="invalid_body",
                    message="body is not valid base64",
                    field=f"{field}.body",
                ) from None
        else:
            body = envelope.body.encode("utf-8")
        limit = self.broker.config.max_body_bytes
        if len(body) > limit:
            raise Invalid(
                code="body_too_large",
                message=f"body is {len(body)} bytes; the limit is {limit}",
                field=f"{field}.body",
            )
        deliver_at_us = 0
        if envelope.deliver_at is not None:
            deliver_at_us = self._deliver_at(envelope.deliver_at, now_us, f"{field}.deliver_at")
        return IncomingMessage(
            id=envelope.id,
            subject=envelope.subject,
            key=envelope.key,
            headers=dict(envelope.headers),
            body=body,
            body_base64=envelope.body_encoding == "base64",
            producer=envelope.producer,
            created_at_us=_micros(envelope.created_at) if envelope.created_at else None,
            deliver_at_us=deliver_at_us,
        )

    def _deliver_at(self, value: datetime, now_us: int, field: str) -> int:
        """A future due time in microseconds, or 0 (deliver now) for one in the past."""
        due = _exact_micros(value)
        if due <= now_us:
            return 0
        limit_s = self.broker.config.max_delay_s
        if due - now_us > limit_s * 1_000_000:
            raise Invalid(
                code="delay_too_long",
                message=f"deliver_at is more than {_span(limit_s)} ahead (--max-delay)",
                field=field,
            )
        return due

    async def pull(self, request: Request) -> Response:
        parsed = await self._parse(request, PullRequest)
        self._authorize(request, "consume", parsed.subject, "subject")
        wait_ms = min(parsed.wait_ms, self.broker.config.max_wait_ms)
        messages = await self.broker.delivery.pull(
            subject=parsed.subject,
            group=parsed.group,
            consumer=parsed.consumer,
            max_messages=parsed.max,
            wait_ms=wait_ms,
            mode=parsed.mode,
            start=parsed.start,
        )
        return _json({"messages": messages})

    async def ack(self, request: Request) -> Response:
        parsed = await self._parse(request, AckRequest)
        self._authorize(request, "consume", parsed.subject, "subject")
        result = await self.broker.delivery.ack(
            subject=parsed.subject, group=parsed.group, consumer=parsed.consumer, seqs=parsed.seqs
        )
        return _json(result)

    async def nack(self, request: Request) -> Response:
        parsed = await self._parse(request, NackRequest)
        self._authorize(request, "consume", parsed.subject, "subject")
        result = await self.broker.delivery.nack(
            subject=parsed.subject,
            group=parsed.group,
            consumer=parsed.consumer,
            seqs=parsed.seqs,
            delay_ms=parsed.delay_ms,
            error=parsed.error,
        )
        return _json(result)

    def _path_name(self, request: Request, name: str) -> str:
        """A subject or group name from the path, checked against the naming rules."""
        value = str(request.path_params[name])
        if not qmq_wire.valid_name(value):
            raise Invalid(
                code=f"invalid_{name}",
                message=f"{name} does not match the naming rules",
                field=name,
            )
        return value

    async def subjects(self, request: Request) -> Response:
        if self.authorizer is not None:
            self.authorizer.grant_for(request.headers.get("authorization"))
        return _json({"subjects": self.broker.stats.subjects()})

    async def subject(self, request: Request) -> Response:
        subject = self._path_name(request, "subject")
        self._authorize(request, "consume", subject, "subject")
        return _json(self.broker.stats.subject(subject))

    async def dead(self, request: Request) -> Response:
        subject = self._path_name(request, "subject")
        group = self._path_name(request, "group")
        self._authorize(request, "consume", subject, "subject")
        limit = _int_param(request, "limit", default=100, low=1, high=1000)
        after = _int_param(request, "after_seq", default=None, low=0, high=2**63 - 1)
        return _json(
            self.broker.delivery.dead_letters(
                subject=subject, group=group, limit=limit, after_seq=after
            )
        )

    async def redrive(self, request: Request) -> Response:
        subject = self._path_name(request, "subject")
        group = self._path_name(request, "group")
        parsed = await self._parse(request, RedriveRequest)
        self._authorize(request, "consume", subject, "subject")
        if (parsed.seqs is None) == (parsed.all is not True):
            raise Invalid(
                code="invalid_redrive",
                message='give either "seqs" or "all": true',
                field="seqs",
            )
        redriven = await self.broker.delivery.redrive(
            subject=subject, group=group, seqs=parsed.seqs
        )
        return _json({"redriven": redriven})

    async def schedule(self, request: Request) -> Response:
        if self.authorizer is not None:
            self.authorizer.grant_for(request.headers.get("authorization"))
        limit = _int_param(request, "limit", default=48, low=1, high=20000)
        return _json(self.broker.stats.schedule(limit=limit))

    async def healthz(self, request: Request) -> Response:
        status = self.broker.status
        if status == "ready":
            return _json({"status": "ok"})
        return _json({"status": status}, status=503)

    async def metrics(self, request: Request) -> Response:
        return Response(
            generate_latest(self.broker.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    async def openapi(self, request: Request) -> Response:
        return _json(openapi_document())


def _int_param(request: Request, name: str, *, default: int | None, low: int, high: int) -> Any:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise Invalid(
            code=f"invalid_{name}",
            message=f"{name} must be an integer in [{low}, {high}]",
            field=name,
        )
    return int(raw)


def _endpoint(api: Api, name: str, handler: Handler) -> Handler:
    histogram = api.broker.metrics.requests

    async def endpoint(request: Request) -> Response:
        began = time.perf_counter()
        try:
            response = await handler(request)
        except RequestError as exc:
            response = error_response(exc)
        histogram.labels(name, str(response.status_code)).observe(time.perf_counter() - began)
        return response

    return endpoint


def create_app(
    broker: Broker, *, authorizer: Authorizer | None = None, lifespan: Any = None
) -> Starlette:
    api = Api(broker, authorizer=authorizer)
    routes = [
        ("/v1/messages", "produce", api.produce, ["POST"]),
        ("/v1/pull", "pull", api.pull, ["POST"]),
        ("/v1/ack", "ack", api.ack, ["POST"]),
        ("/v1/nack", "nack", api.nack, ["POST"]),
        ("/v1/subjects", "subjects", api.subjects, ["GET"]),
        ("/v1/subjects/{subject}", "subject", api.subject, ["GET"]),
        ("/v1/subjects/{subject}/groups/{group}/dead", "dead", api.dead, ["GET"]),
        ("/v1/subjects/{subject}/groups/{group}/dead/redrive", "redrive", api.redrive, ["POST"]),
        ("/v1/schedule", "schedule", api.schedule, ["GET"]),
        ("/healthz", "healthz", api.healthz, ["GET"]),
        ("/metrics", "metrics", api.metrics, ["GET"]),
        ("/openapi.json", "openapi", api.openapi, ["GET"]),
    ]
    app = Starlette(
        routes=[
            Route(path, _endpoint(api, name, fn), methods=methods)
            for path, name, fn, methods in routes
        ],
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed, 500: _internal},
    )
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(NotFound(code="not_found", message=f"no route {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(
        Invalid(code="method_not_allowed", message=f"{request.method} is not allowed here")
    )


async def _internal(request: Request, exc: Exception) -> Response:
    return error_response(
        RequestError(code="internal", message="internal error; see the broker log")
    )
