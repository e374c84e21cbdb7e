"""Lean HTTP/1.1 transports for httpx: the SDK's default for a plain ``http://`` broker.

Through httpx's default path (``httpx.Client`` over httpcore and h11) one produce of 100
pre-encoded messages cost more client CPU than the client's own work on the 100 messages;
through these transports, sent to directly by ``qmq_outbox.client``, about a third of it
(responses are framed by httptools, in C).
``fits`` says when they are used: plain ``http://``, and no proxy configured in the
environment (httpx would route through it; these transports do not speak to proxies).
Any transport given to a client explicitly is used as it is.
"""

from __future__ import annotations

import urllib.request

import httpx

from qmq_outbox.http11.aio import AsyncHttp11Transport
from qmq_outbox.http11.parse import Parsed, RequestHead
from qmq_outbox.http11.sync import Http11Transport, Timeouts

__all__ = [
    "AsyncHttp11Transport",
    "Http11Transport",
    "Parsed",
    "RequestHead",
    "Timeouts",
    "answer",
    "fits",
]


def fits(base_url: str) -> bool:
    """Whether the lean transports can serve ``base_url`` as httpx's default would."""
    proxies = urllib.request.getproxies()
    return httpx.URL(base_url).scheme == "http" and "http" not in proxies and "all" not in proxies


def answer(parsed: Parsed) -> tuple[int, bytes]:
    """Status and body of ``parsed``; a compressed body is decoded the way httpx does."""
    if not parsed.encoded:
        return parsed.status, parsed.body
    response = parsed.response()
    response.read()
    return response.status_code, response.content
