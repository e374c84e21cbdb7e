"""The hot routes' way in: produce, pull, ack and nack without Starlette's layers.

Through Starlette a request passes its error middleware, the guard, the exception
middleware, the router (a match against every route in turn) and the request/response
wrapper, each with closures of its own around ``receive`` and ``send``. That cost about as
much CPU per request as producing one message does. Nearly every request a busy broker
serves goes to one of these four routes, so ``HotRoutes`` sends them straight to their
endpoints, found by exact method and path, through the same guard, the same endpoint
wrapper (auth, error answers, metrics) and, for anything unexpected, the same 500 answer
that Starlette gives. Every other request, and the lifespan, goes on to the Starlette app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from qmq_broker.http.errors import error_response, internal_error_response
from qmq_broker.http.guard import GuardPolicy

Handler = Callable[[Request], Awaitable[Response]]


class HotRoutes:
    """ASGI app in front of ``app``: ``routes`` (POST path -> endpoint) served directly."""

    def __init__(self, app: ASGIApp, *, routes: Mapping[str, Handler], guard: GuardPolicy) -> None:
        self.app = app
        self._routes = dict(routes)
        self._guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._routes.get(scope["path"])
            if endpoint is not None:
                await self._serve(endpoint, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, endpoint: Handler, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._guard.refusal(scope)
        if refusal is not None:
            await _answer(error_response(refusal), send)
            return
        try:
            response = await endpoint(Request(scope, receive))
        except Exception:
            # as Starlette's error middleware does: a 500 naming no detail, and the
            # exception raised on for the server to log
            await _answer(internal_error_response(), send)
            raise
        await _answer(response, send)


async def _answer(response: Response, send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})
