"""Routes of API v1 over the broker's services: size limits, validation, auth, JSON."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import qmq_wire
from qmq_broker.console.http import ConsoleAssets
from qmq_broker.errors import Denied, Invalid, NotFound, RequestError
from qmq_broker.http import bodies
from qmq_broker.http.auth import Authorizer, Grant, Right
from qmq_broker.http.errors import error_response, from_validation, internal_error_response
from qmq_broker.http.guard import GuardPolicy, RequestGuard, content_type_error
from qmq_broker.http.hot import HotRoutes
from qmq_broker.http.incoming import incoming_messages
from qmq_broker.http.openapi import DEFAULT_SCHEDULE_HOURS, MAX_SCHEDULE_HOURS, openapi_document
from qmq_broker.http.overhead import LoopOverhead
from qmq_broker.http.params import int_param, path_name, require_sight
from qmq_broker.http.schemas import (
    DeclareRequest,
    MergeRequest,
    MoveRequest,
    RedriveRequest,
    ResetRequest,
    SplitRequest,
)
from qmq_broker.services import Services, Shared
from qmq_wire import rules
from qmq_wire.records import RECORDS_MEDIA_TYPE, records_answer

M = TypeVar("M", bound=BaseModel)
Settle = TypeVar("Settle", bodies.AckBody, bodies.NackBody)
if TYPE_CHECKING:
    from qmq_broker.engine import Broker  # create_app unpacks it into the services above

Handler = Callable[[Request], Awaitable[Response]]
_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


class Api:
    """Binds HTTP requests to the broker's services: size limits, validation, auth, errors."""

    def __init__(
        self,
        *,
        shared: Shared,
        services: Callable[[], Services],
        pull_work_s: Callable[[], float],
        authorizer: Authorizer | None = None,
    ) -> None:
        self.shared = shared  # settings, time, metrics, lifecycle, consumers heard from
        self.services = services  # answers ``recovering`` until the broker is ready
        self.authorizer = authorizer
        self.overhead = LoopOverhead(pull_work_s)

    async def _body(self, request: Request) -> bytes:
        refusal = content_type_error(request.headers.get("content-type"))
        if refusal is not None:
            raise refusal
        limit = self.shared.config.max_request_bytes
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
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # most come in one piece

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

    def _grant(self, request: Request) -> Grant | None:
        """The caller's grant, checked from the headers alone: before any body is read, a
        request without a valid token costs nothing more. ``None`` when auth is off."""
        if self.authorizer is None:
            return None
        return self.authorizer.grant_for(request.headers.get("authorization"))

    @staticmethod
    def _require(
        grant: Grant | None, right: Right, subject: str, *, group: str | None = None, field: str
    ) -> None:
        if grant is not None:
            Authorizer.require(grant, right, subject, group=group, field=field)

    # --- endpoints ------------------------------------------------------------------------

    async def produce(self, request: Request) -> Response:
        grant = self._grant(request)
        envelopes = bodies.decode(await self._body(request), bodies.ProduceBody).messages
        if grant is not None:
            allowed: set[str] = set()  # a batch mostly names one subject: check each once
            for i, envelope in enumerate(envelopes):
                if envelope.subject not in allowed:
                    field = f"messages[{i}].subject"
                    Authorizer.require(grant, Right.PRODUCE, envelope.subject, field=field)
                    allowed.add(envelope.subject)
        messages = incoming_messages(
            envelopes,
            now_us=self.shared.clock.wall_us(),
            max_body_bytes=self.shared.config.max_body_bytes,
            max_delay_s=self.shared.config.max_delay_s,
        )
        results = await self.services().producer.produce(messages)
        return _json({"results": results})

    async def pull(self, request: Request) -> Response:
        grant = self._grant(request)
        body = await self._body(request)
        began = time.thread_time()  # CPU, as the actors' work is counted (``Served``)
        parsed = bodies.decode(body, bodies.PullBody)
        self._require(grant, Right.CONSUME, parsed.subject, group=parsed.group, field="group")
        self.shared.recent_consumers.saw(parsed.subject, parsed.group, parsed.consumer)
        wait_ms = min(parsed.wait_ms, self.shared.config.max_wait_ms)
        # A client that reads records (the SDK's) asks for them: no JSON per message.
        records = RECORDS_MEDIA_TYPE in request.headers.get("accept", "")
        decoded = time.thread_time()
        messages, acked = await self.services().delivery.ack_and_pull(
            subject=parsed.subject,
            group=parsed.group,
            consumer=parsed.consumer,
            max_messages=parsed.max,
            wait_ms=wait_ms,
            mode=parsed.mode,
            start=parsed.position,
            ack=parsed.ack,
            min_messages=min(parsed.min, parsed.max),  # a larger min asks for a full batch
            linger_ms=parsed.linger_ms,
            max_keys=parsed.max_keys,
            tags=parsed.tags,
            records=records,
        )
        answered = time.thread_time()
        fields: dict[str, object] = {}
        if acked is not None:
            fields = {"acked": acked.acked, "unknown": acked.unknown}
        if records:
            answer = records_answer(orjson.dumps(fields), cast("list[bytes]", messages))
            response = Response(answer, media_type=RECORDS_MEDIA_TYPE)
        else:
            response = _json({"messages": messages, **fields})
        # The request's own work outside the pull scheduler counts toward its group's share.
        spent = decoded - began + time.thread_time() - answered
        self.services().delivery.charge(
            subject=parsed.subject,
            group=parsed.group,
            measured=spent,
            estimated=self.overhead.per_request,
        )
        return response

    async def _settle(
        self, request: Request, body: type[Settle], settle: Callable[..., Awaitable[object]]
    ) -> Response:
        """An ack or nack: its body decoded, its consumer allowed on its group and seen, and
        the body's fields (named as ``settle``'s keywords) handed to ``settle``."""
        grant = self._grant(request)
        parsed = bodies.decode(await self._body(request), body)
        self._require(grant, Right.CONSUME, parsed.subject, group=parsed.group, field="group")
        self.shared.recent_consumers.saw(parsed.subject, parsed.group, parsed.consumer)
        return _json(await settle(**msgspec.structs.asdict(parsed)))

    async def ack(self, request: Request) -> Response:
        return await self._settle(request, bodies.AckBody, self.services().delivery.ack)

    async def nack(self, request: Request) -> Response:
        return await self._settle(request, bodies.NackBody, self.services().delivery.nack)

    async def subjects(self, request: Request) -> Response:
        grant = self._grant(request)
        listed = self.services().stats.subjects()
        if grant is not None:
            listed = [stats for stats in listed if grant.sees(stats.subject)]
        return _json({"subjects": listed})

    async def subject(self, request: Request) -> Response:
        grant = self._grant(request)
        subject = path_name(request, "subject")
        require_sight(grant, subject)
        detail = self.services().stats.subject(subject)
        if grant is not None:
            shown = [g for g in detail.groups if grant.sees(subject, g.group)]
            detail = dataclasses.replace(detail, groups=shown)
        return _json(detail)

    def _managed_group(self, request: Request) -> tuple[str, str]:
        """The subject and group in the path, the caller allowed to manage that group."""
        grant = self._grant(request)
        subject = path_name(request, "subject")
        group = path_name(request, "group")
        self._require(grant, Right.MANAGE, subject, group=group, field="group")
        return subject, group

    async def dead(self, request: Request) -> Response:
        subject, group = self._managed_group(request)
        limit = int_param(
            request, "limit", default=qmq_wire.DEFAULT_DEAD_PAGE, high=qmq_wire.MAX_DEAD_PAGE
        )
        after = int_param(request, "after_seq", default=None, low=0, high=qmq_wire.MAX_SEQ)
        partition = int_param(
            request, "partition", default=None, low=0, high=qmq_wire.MAX_PARTITION_NUMBER
        )
        return _json(
            self.services().delivery.dead_letters(
                subject=subject, group=group, limit=limit, after_seq=after, partition=partition
            )
        )

    async def redrive(self, request: Request) -> Response:
        subject, group = self._managed_group(request)
        parsed = await self._parse(request, RedriveRequest)
        if (parsed.seqs is None) == (parsed.all is not True):
            raise Invalid(
                code="invalid_redrive",
                message='give either "seqs" or "all": true',
                field="seqs",
            )
        redriven = await self.services().delivery.redrive(
            subject=subject, group=group, seqs=parsed.seqs, partition=parsed.partition
        )
        return _json({"redriven": redriven})

    async def reset(self, request: Request) -> Response:
        subject, group = self._managed_group(request)
        parsed = await self._parse(request, ResetRequest)
        to = rules.Position.of(parsed.to)
        assert to is not None  # the model checked it
        result = await self.services().resets.reset(
            subject=subject, group=group, to=to, force=parsed.force, partition=parsed.partition
        )
        return _json(result)

    # --- ordered subjects -------------------------------------------------------------------

    def _require_admin(self, request: Request, subject: str) -> None:
        """Declaring a subject and changing its routes concern every group: admin only."""
        grant = self._grant(request)
        if grant is not None and not grant.admin:
            raise Denied(
                code="forbidden",
                message=f"token {grant.name!r} may not change {subject!r}: it needs admin",
                field="subject",
            )

    async def subject_or_declare(self, request: Request) -> Response:
        """One route per path, so that a 405 names every method the path allows."""
        if request.method == "PUT":
            return await self.declare(request)
        return await self.subject(request)

    async def declare(self, request: Request) -> Response:
        subject = path_name(request, "subject")
        self._require_admin(request, subject)
        parsed = await self._parse(request, DeclareRequest)
        routes = await self.services().routes.declare(
            subject, partitions=parsed.partitions, on_dead=parsed.on_dead
        )
        return _json(routes)

    async def routes(self, request: Request) -> Response:
        grant = self._grant(request)
        subject = path_name(request, "subject")
        require_sight(grant, subject)
        return _json(self.services().routes.document(subject))

    async def split(self, request: Request) -> Response:
        subject = path_name(request, "subject")
        self._require_admin(request, subject)
        parsed = await self._parse(request, SplitRequest)
        return _json(
            await self.services().routes.split(subject, partition=parsed.partition, at=parsed.at)
        )

    async def merge(self, request: Request) -> Response:
        subject = path_name(request, "subject")
        self._require_admin(request, subject)
        parsed = await self._parse(request, MergeRequest)
        return _json(await self.services().routes.merge(subject, partitions=parsed.partitions))

    async def move(self, request: Request) -> Response:
        subject = path_name(request, "subject")
        self._require_admin(request, subject)
        parsed = await self._parse(request, MoveRequest)
        return _json(await self.services().routes.move(subject, partition=parsed.partition))

    async def schedule(self, request: Request) -> Response:
        grant = self._grant(request)
        if grant is not None and not grant.manages_all:
            raise Denied(
                code="forbidden",
                message=f"token {grant.name!r} may not see the schedule: it needs manage on '*'",
            )
        limit = int_param(request, "limit", default=DEFAULT_SCHEDULE_HOURS, high=MAX_SCHEDULE_HOURS)
        return _json(self.services().stats.schedule(limit=limit))

    # --- the console's views (docs/console.md) -----------------------------------------------

    async def console_overview(self, request: Request) -> Response:
        """Any valid token; it sees the subjects and groups it has a right on."""
        grant = self._grant(request)
        if grant is None:
            return _json(self.services().console.overview())
        return _json(self.services().console.overview(sees=grant.sees))

    async def console_subject(self, request: Request) -> Response:
        grant = self._grant(request)
        subject = path_name(request, "subject")
        require_sight(grant, subject)
        if grant is None:
            return _json(self.services().console.subject(subject))
        return _json(self.services().console.subject(subject, sees=grant.sees))

    async def healthz(self, request: Request) -> Response:
        status = self.shared.lifecycle.status.value
        if status == "ready":
            return _json({"status": "ok"})
        return _json({"status": status}, status=503)

    async def metrics(self, request: Request) -> Response:
        return Response(
            generate_latest(self.shared.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    async def openapi(self, request: Request) -> Response:
        return _json(openapi_document(auth=self.authorizer is not None))


def _endpoint(api: Api, name: str, handler: Handler) -> Handler:
    histogram = api.shared.metrics.requests

    async def endpoint(request: Request) -> Response:
        api.overhead.request()
        began = time.perf_counter()
        try:
            response = await handler(request)
        except RequestError as exc:
            response = error_response(exc)
        histogram.labels(name, str(response.status_code)).observe(time.perf_counter() - began)
        return response

    return endpoint


def create_app(
    broker: Broker,
    *,
    authorizer: Authorizer | None = None,
    guard: GuardPolicy | None = None,
    lifespan: Any = None,
) -> HotRoutes:
    """The broker's HTTP app; ``guard`` defaults to a broker bound to 127.0.0.1."""
    api = Api(
        shared=broker.shared,
        services=lambda: broker.services,
        pull_work_s=broker.measured_pull_work_s,
        authorizer=authorizer,
    )
    console = ConsoleAssets()
    routes = [
        ("/v1/messages", "produce", api.produce, ["POST"]),
        ("/v1/pull", "pull", api.pull, ["POST"]),
        ("/v1/ack", "ack", api.ack, ["POST"]),
        ("/v1/nack", "nack", api.nack, ["POST"]),
        ("/v1/subjects", "subjects", api.subjects, ["GET"]),
        ("/v1/subjects/{subject}", "subject", api.subject_or_declare, ["GET", "PUT"]),
        ("/v1/subjects/{subject}/routes", "routes", api.routes, ["GET"]),
        ("/v1/subjects/{subject}/partitions/split", "split", api.split, ["POST"]),
        ("/v1/subjects/{subject}/partitions/merge", "merge", api.merge, ["POST"]),
        ("/v1/subjects/{subject}/partitions/move", "move", api.move, ["POST"]),
        ("/v1/subjects/{subject}/groups/{group}/dead", "dead", api.dead, ["GET"]),
        ("/v1/subjects/{subject}/groups/{group}/dead/redrive", "redrive", api.redrive, ["POST"]),
        ("/v1/subjects/{subject}/groups/{group}/reset", "reset", api.reset, ["POST"]),
        ("/v1/schedule", "schedule", api.schedule, ["GET"]),
        ("/healthz", "healthz", api.healthz, ["GET"]),
        ("/metrics", "metrics", api.metrics, ["GET"]),
        ("/openapi.json", "openapi", api.openapi, ["GET"]),
        ("/v1/console/overview", "console_overview", api.console_overview, ["GET"]),
        ("/v1/console/subjects/{subject}", "console_subject", api.console_subject, ["GET"]),
        ("/console", "console", console.index, ["GET"]),
        ("/console/{name}", "console", console.asset, ["GET"]),
    ]
    endpoints = [(path, _endpoint(api, name, fn), methods) for path, name, fn, methods in routes]
    policy = guard or GuardPolicy.for_bind("127.0.0.1", allow_origins=())
    app = Starlette(
        routes=[Route(path, endpoint, methods=methods) for path, endpoint, methods in endpoints],
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed, 500: _internal},
    )
    app.add_middleware(RequestGuard, policy=policy)
    # the requests a busy broker serves all but go around Starlette's layers
    hot = {path: endpoint for path, endpoint, methods in endpoints if path in HOT_PATHS}
    return HotRoutes(app, routes=hot, guard=policy)


HOT_PATHS = frozenset({"/v1/messages", "/v1/pull", "/v1/ack", "/v1/nack"})


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(NotFound(code="not_found", message=f"no route {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    response = error_response(
        Invalid(code="method_not_allowed", message=f"{request.method} is not allowed here")
    )
    allow = getattr(exc, "headers", None) or {}
    if "Allow" in allow:  # Starlette names the route's methods
        response.headers["Allow"] = allow["Allow"]
    return response


async def _internal(request: Request, exc: Exception) -> Response:
    return internal_error_response()
