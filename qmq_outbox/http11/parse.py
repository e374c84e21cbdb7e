"""HTTP/1.1 on the client side without I/O: a request's bytes, a response from bytes.

``RequestHead`` is a request's line and headers, to which each request adds its body.
``ResponseParser`` is fed whatever the socket gave and answers a ``Parsed`` response once
one is complete. The framing is httptools' (llhttp, uvicorn's parser too): bodies framed by
``Content-Length``, by chunked transfer coding, or by the end of the connection, and its
strict refusals (conflicting lengths, both framings at once, bare LF, bytes past the
response). On top of it: informational (1xx) answers skipped, a Transfer-Encoding other
than chunked, another HTTP version or a head past ``MAX_HEAD`` refused. Every refusal is a
``ProtocolError``, which the transports turn into httpx's ``RemoteProtocolError``. The
transports in ``sync.py`` and ``aio.py`` only move bytes.
"""

from __future__ import annotations

import dataclasses

import httptools
import httpx

MAX_HEAD = 64 * 1024  # status line and headers
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response."""


@dataclasses.dataclass(frozen=True, slots=True)
class Parsed:
    """A complete response: what ``httpx.Response`` needs, and whether the connection can
    carry another request."""

    status: int
    reason: bytes
    http_version: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    encoded: bool  # a Content-Encoding other than identity: ``response()`` decodes it

    def response(self) -> httpx.Response:
        extensions = {"http_version": self.http_version, "reason_phrase": self.reason}
        stream = httpx.ByteStream(self.body)
        return httpx.Response(
            self.status, headers=self.headers, stream=stream, extensions=extensions
        )


Origin = tuple[str, int]  # host, port


def origin(url: httpx.URL) -> Origin:
    if url.scheme != "http":
        raise httpx.UnsupportedProtocol(f"plain http only, not {url.scheme!r}")
    return url.host, url.port or 80


@dataclasses.dataclass(frozen=True, slots=True)
class RequestHead:
    """Where a request goes and its head up to the body's framing: the same for every
    request a client sends to one path, so the SDK's client keeps it and only adds bodies."""

    origin: Origin
    method: str
    lines: bytes  # the request line and headers, each ending in CRLF; no Content-Length
    length_always: bool  # a Content-Length even for an empty body (POST, or a framed one)

    @classmethod
    def of(cls, request: httpx.Request) -> RequestHead:
        """``request``'s head. A streamed body is read whole before sending, so it goes out
        with a ``Content-Length`` instead of the chunked coding httpx announced."""
        lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), request.url.raw_path)]
        framed = False
        for name, value in request.headers.raw:
            if name.lower() in _FRAMING:
                framed = True
                continue
            lines.append(b"%s: %s\r\n" % (name, value))
        always = framed or request.method in ("POST", "PUT", "PATCH")
        return cls(origin(request.url), request.method, b"".join(lines), always)

    def request(self, body: bytes) -> bytes:
        """The whole request with ``body``."""
        if body or self.length_always:
            return b"".join((self.lines, b"Content-Length: %d\r\n\r\n" % len(body), body))
        return self.lines + b"\r\n"


def request_bytes(request: httpx.Request, body: bytes) -> bytes:
    """``request`` as bytes, with ``body`` (read from it)."""
    return RequestHead.of(request).request(body)


class ResponseParser:
    """One response, from the bytes of one connection (``head_only`` for a HEAD request),
    framed by httptools (llhttp); this class only keeps what its callbacks report."""

    def __init__(self, *, head_only: bool = False) -> None:
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._head_only = head_only
        self._status = 0
        self._reason = b""
        self._version = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._framed = False  # a Content-Length or a Transfer-Encoding: not ended by EOF
        self._encoded = False
        self._headed = False  # the final (not 1xx) head is complete
        self._head_size = 0  # bytes fed before that
        self._parsed: Parsed | None = None
        self.started = False  # whether any byte of a response has come

    def feed(self, data: bytes | memoryview) -> Parsed | None:
        """Take ``data``; the response once it is complete (bytes past it are an error)."""
        parser = self._parser
        if parser is None:
            raise ProtocolError("bytes after the response (no request was pipelined)")
        if data:
            self.started = True
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._parser = None
            raise _refusal(exc) from exc
        if self._parsed is not None:
            # done: the parser holds our callbacks, so it goes now rather than at the next
            # garbage collection, and the body's pieces with it
            self._parser = None
        elif not self._headed:
            self._head_size += len(data)
            if self._head_size > MAX_HEAD:
                raise ProtocolError(f"response head longer than {MAX_HEAD} bytes")
        return self._parsed

    def feed_eof(self) -> Parsed:
        """The connection ended: the response if its body was framed by that, else raise."""
        self._parser = None
        if self._headed and self._parsed is None and not self._framed:
            return self._response(keep_alive=False)  # it ended
        raise ProtocolError("server disconnected without sending a complete response")

    # -- httptools' callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._parsed is not None:
            raise ProtocolError("bytes after the response (no request was pipelined)")
        self._reason = b""
        self._headers = []  # an informational answer's are not the response's

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._headed:
            return  # a chunked body's trailers: ignored, as httpx does
        value = value.rstrip(b" \t")  # llhttp drops the leading whitespace only
        self._headers.append((name, value))
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            if value.lower().rsplit(b",", 1)[-1].strip() != b"chunked":
                raise ProtocolError(f"unsupported Transfer-Encoding: {value[:40]!r}")
            self._framed = True
        elif lowered == b"content-length":
            self._framed = True
        elif lowered == b"content-encoding":
            self._encoded = value.lower() not in (b"", b"identity")

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if status < 200:
            return  # informational: the real answer follows
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise ProtocolError(f"not an HTTP/1.1 response: HTTP/{version}")
        self._status, self._version, self._headed = status, b"HTTP/" + version.encode(), True
        if self._head_only:
            self._parsed = self._response(parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self._parsed is not None:  # after a HEAD answer
            raise ProtocolError("bytes after the response (no request was pipelined)")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._headed and self._parsed is None:
            parser = self._parser
            assert parser is not None
            self._parsed = self._response(parser.should_keep_alive())

    def _response(self, keep_alive: bool) -> Parsed:
        return Parsed(
            self._status,
            self._reason,
            self._version,
            self._headers,
            b"".join(self._body),  # of one piece: that piece, not a copy
            keep_alive,
            self._encoded,
        )


def _refusal(exc: Exception) -> ProtocolError:
    """``exc`` from httptools as ``ProtocolError``: ours if a callback raised it."""
    if isinstance(exc.__context__, ProtocolError):
        return exc.__context__
    if isinstance(exc, httptools.HttpParserUpgrade):
        return ProtocolError("a protocol upgrade nobody asked for")
    return ProtocolError(f"not an HTTP/1.1 response: {exc}")
