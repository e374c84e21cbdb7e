"""HTTP/1.1 on the client side without I/O: a request's bytes, a response from bytes.

``RequestHead`` is a request's line and headers, to which each request adds its body.
``ResponseParser`` is fed whatever the socket gave and answers a ``Parsed`` response once
one is complete: bodies framed by ``Content-Length``, by chunked transfer coding, or by the
end of the connection; informational (1xx) answers skipped; anything else raises
``ProtocolError``, which the transports turn into httpx's ``RemoteProtocolError``. The
transports in ``sync.py`` and ``aio.py`` only move bytes.
"""

from __future__ import annotations

import dataclasses

import httpx

MAX_HEAD = 64 * 1024  # status line and headers
_NO_BODY = frozenset((204, 304))
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Head:
    status: int
    reason: bytes
    http_version: bytes
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool  # as the headers say (a body framed by the connection's end: no)
    length: int | None  # None: chunked, or until the connection ends
    chunked: bool
    encoded: bool


def _parse_head(block: bytes) -> _Head:
    lines = block.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise ProtocolError(f"not an HTTP/1.1 status line: {lines[0][:100]!r}")
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    chunked = encoded = False
    connection = b""
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise ProtocolError(f"malformed header line: {line[:100]!r}")
        value = value.strip()
        headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise ProtocolError(f"bad Content-Length: {value[:40]!r}")
            length = int(value)
        elif lowered == b"transfer-encoding":
            if value.lower().rsplit(b",", 1)[-1].strip() != b"chunked":
                raise ProtocolError(f"unsupported Transfer-Encoding: {value[:40]!r}")
            chunked = True
        elif lowered == b"connection":
            connection = value.lower()
        elif lowered == b"content-encoding":
            encoded = value.lower() not in (b"", b"identity")
    keep_alive = b"close" not in connection and (
        version == b"HTTP/1.1" or b"keep-alive" in connection
    )
    if chunked:  # it wins over a Content-Length, but such a server is not to be trusted twice
        keep_alive = keep_alive and length is None
        length = None
    return _Head(int(code), reason, version, headers, keep_alive, length, chunked, encoded)


class ResponseParser:
    """One response, from the bytes of one connection (``head_only`` for a HEAD request)."""

    def __init__(self, *, head_only: bool = False) -> None:
        self._buffer = bytearray()
        self._head_only = head_only
        self._head: _Head | None = None
        self._at = 0  # where the unparsed bytes start: the head, the body, the next chunk
        self._chunks: list[bytes] = []

    @property
    def started(self) -> bool:
        """Whether any byte of a response has come."""
        return bool(self._buffer)

    def feed(self, data: bytes | memoryview) -> Parsed | None:
        """Take ``data``; the response once it is complete (bytes past it are an error)."""
        buffer = self._buffer
        buffer += data
        while self._head is None:
            end = buffer.find(b"\r\n\r\n", self._at)
            if end < 0:
                if len(buffer) - self._at > MAX_HEAD:
                    raise ProtocolError(f"response head longer than {MAX_HEAD} bytes")
                return None
            head = _parse_head(bytes(buffer[self._at : end]))
            self._at = end + 4
            if 100 <= head.status < 200:
                continue  # informational: the real answer follows
            self._head = head
            if self._head_only or head.status in _NO_BODY:
                return self._done(b"", self._at, head.keep_alive)
        head = self._head
        if head.chunked:
            return self._feed_chunks(head.keep_alive)
        if head.length is not None and len(buffer) - self._at >= head.length:
            end = self._at + head.length
            return self._done(bytes(memoryview(buffer)[self._at : end]), end, head.keep_alive)
        return None

    def feed_eof(self) -> Parsed:
        """The connection ended: the response if its body was framed by that, else raise."""
        head = self._head
        if head is not None and head.length is None and not head.chunked:
            body = bytes(memoryview(self._buffer)[self._at :])
            return self._done(body, len(self._buffer), keep_alive=False)  # it ended
        raise ProtocolError("server disconnected without sending a complete response")

    def _feed_chunks(self, keep_alive: bool) -> Parsed | None:
        buffer = self._buffer
        while True:
            line_end = buffer.find(b"\r\n", self._at)
            if line_end < 0:
                return None
            size_text = bytes(buffer[self._at : line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size: {size_text[:20]!r}") from None
            if size == 0:  # the last chunk, then trailers (ignored) up to an empty line
                end = buffer.find(b"\r\n\r\n", line_end)
                if end < 0:
                    return None
                return self._done(b"".join(self._chunks), end + 4, keep_alive)
            data_end = line_end + 2 + size
            if len(buffer) < data_end + 2:
                return None
            if buffer[data_end : data_end + 2] != b"\r\n":
                raise ProtocolError("chunk data not followed by CRLF")
            self._chunks.append(bytes(memoryview(buffer)[line_end + 2 : data_end]))
            self._at = data_end + 2

    def _done(self, body: bytes, end: int, keep_alive: bool) -> Parsed:
        head = self._head
        assert head is not None
        if len(self._buffer) > end:
            raise ProtocolError("bytes after the response (no request was pipelined)")
        return Parsed(
            head.status,
            head.reason,
            head.http_version,
            head.headers,
            body,
            keep_alive,
            head.encoded,
        )
