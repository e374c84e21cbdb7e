"""Checks every request passes before any route sees it: Host and Origin.

A broker on a developer's machine runs without auth on 127.0.0.1. Any web page that machine
opens could otherwise write to it: a ``text/plain`` POST needs no CORS preflight (CSRF), and
a hostile name that resolves to 127.0.0.1 reaches it with a foreign ``Host`` (DNS
rebinding). So a request that carries an ``Origin`` header is refused unless that origin is
allowed or is the broker's own (its ``/console`` page), and a ``Host`` that is not allowed is
refused (403). The third rule, a POST
body must be ``Content-Type: application/json`` (which no browser sends cross-site without
a preflight the broker never grants), is ``content_type_error``, applied by the routes that
take a body, so a POST to a GET route is still a 405.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from qmq_broker.errors import Denied, Invalid, RequestError
from qmq_broker.http.errors import error_response

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GuardPolicy:
    """Which ``Host`` and ``Origin`` values are served.

    ``hosts`` are host names or addresses without a port; ``None`` serves any ``Host``.
    ``origins`` are exact origins (``https://console.example.com``) or ``"*"``.
    """

    hosts: frozenset[str] | None
    origins: frozenset[str] = frozenset()

    @classmethod
    def for_bind(
        cls, bind_host: str, *, allow_hosts: tuple[str, ...] = (), allow_origins: tuple[str, ...]
    ) -> GuardPolicy:
        """The default: the bound address and ``localhost``, plus ``allow_hosts``.

        A wildcard bind (``0.0.0.0``, ``::``) has no one name to check, so without
        ``allow_hosts`` any ``Host`` is served; ``"*"`` in ``allow_hosts`` does the same.
        """
        if "*" in allow_hosts or (_wildcard(bind_host) and not allow_hosts):
            return cls(hosts=None, origins=frozenset(allow_origins))
        hosts = {h.lower().strip("[]") for h in allow_hosts} | LOCAL_NAMES
        if not _wildcard(bind_host):
            hosts.add(bind_host.lower().strip("[]"))
        return cls(hosts=frozenset(hosts), origins=frozenset(allow_origins))

    def refusal(self, scope: Scope) -> RequestError | None:
        """Why the HTTP request of ``scope`` is refused (a 403), or ``None``."""
        headers = Headers(scope=scope)
        hosts = self.hosts
        if hosts is not None and host_name(headers.get("host", "")) not in hosts:
            return Denied(
                code="host_not_allowed",
                message="this Host is not served (--allow-host)",
                field="Host",
            )
        origin = headers.get("origin")
        allowed = self.origins
        if (
            origin is not None
            and "*" not in allowed
            and origin not in allowed
            and not _same_origin(origin, scope, headers)
        ):
            return Denied(
                code="origin_not_allowed",
                message=f"requests from origin {origin!r} are not allowed (--allow-origin)",
                field="Origin",
            )
        return None


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def host_name(header: str) -> str:
    """``Host`` without its port: ``[::1]:80`` -> ``::1``, ``example.com:80`` -> ``example.com``."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    name, _, _ = value.partition(":")
    return name


class RequestGuard:
    """ASGI middleware refusing requests by ``Host`` and ``Origin`` (``GuardPolicy.refusal``)."""

    def __init__(self, app: ASGIApp, *, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.policy.refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _same_origin(origin: str, scope: Scope, headers: Headers) -> bool:
    """The broker's own pages (``/console``): a browser sends ``Origin`` with their POSTs,
    naming the scheme and the ``Host`` it asked for, which the Host rule already allowed.
    A page from anywhere else names its own origin, never this one."""
    host = headers.get("host")
    return host is not None and origin.lower() == f"{scope.get('scheme', 'http')}://{host.lower()}"


def content_type_error(content_type: str | None) -> RequestError | None:
    """415 unless the body is declared ``application/json`` (parameters such as charset ok)."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type == "application/json":
        return None
    return Invalid(
        code="unsupported_media_type",
        message="a POST body must be sent as Content-Type: application/json",
        field="Content-Type",
    )
