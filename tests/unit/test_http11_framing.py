"""How the SDK's HTTP/1.1 transports read responses (httptools frames them), over sockets.

Each response is written by a scripted server, whole or a few bytes at a time, and read by
the blocking and the asyncio transports alike: bodies framed by ``Content-Length``, by the
chunked coding or by the connection's end; which connections are kept; and what is refused
(``httpx.RemoteProtocolError``, the connection dropped): malformed, truncated, oversized.
"""

from __future__ import annotations

import gzip

import httpx
import pytest

from qmq_outbox.http11.parse import MAX_HEAD
from tests.unit.http_script import KIND_IDS, KINDS, Blocking, Reply, Seen, get, ok, scripted

pytestmark = pytest.mark.timeout(30)

LENGTH = (
    b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"a": "bc"}'
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;name=value\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nx-trailer: yes\r\n\r\n"
)
BYTE_BY_BYTE = 10_000  # pieces: more than any reply here has bytes


@pytest.fixture(params=KINDS, ids=KIND_IDS)
def kind(request: pytest.FixtureRequest) -> type[Blocking]:
    kind_: type[Blocking] = request.param
    return kind_


def twice(kind: type[Blocking], reply: Reply, first: str = "/") -> tuple[list[object], list[int]]:
    """``reply`` to a request for ``first``, then a plain 200 to a second request: both
    answers, and the connection each request came on."""

    def answer(seen: Seen) -> Reply:
        return reply if seen.path == first else ok()

    with scripted(answer) as server:
        answers = kind().run(server.url, [get(first), get("/next")])
    return answers, [s.connection for s in server.seen]


@pytest.mark.parametrize("pieces", [1, 2, 7, BYTE_BY_BYTE])
def test_a_length_framed_body_in_any_pieces(kind: type[Blocking], pieces: int) -> None:
    (response, after), connections = twice(kind, Reply(LENGTH, pieces=pieces))
    assert isinstance(response, httpx.Response)
    assert (response.status_code, response.reason_phrase) == (200, "OK")
    assert response.content == b'{"a": "bc"}'
    assert response.headers.raw[0] == (b"content-type", b"application/json")
    assert isinstance(after, httpx.Response)
    assert connections == [1, 1]


@pytest.mark.parametrize("pieces", [1, 5, BYTE_BY_BYTE])
def test_a_chunked_body_in_any_pieces(kind: type[Blocking], pieces: int) -> None:
    (response, _), connections = twice(kind, Reply(CHUNKED, pieces=pieces))
    assert isinstance(response, httpx.Response)
    assert response.content == b"hello world"
    assert "x-trailer" not in response.headers  # trailers are dropped, as httpx does
    assert connections == [1, 1]


def test_informational_answers_are_skipped(kind: type[Blocking]) -> None:
    early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
    (response, _), connections = twice(kind, Reply(early + LENGTH))
    assert isinstance(response, httpx.Response)
    assert (response.status_code, response.content) == (200, b'{"a": "bc"}')
    assert "link" not in response.headers
    assert connections == [1, 1]


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
def test_statuses_without_a_body(kind: type[Blocking], status: bytes) -> None:
    (response, _), connections = twice(kind, Reply(b"HTTP/1.1 " + status + b"\r\n\r\n"))
    assert isinstance(response, httpx.Response)
    assert response.content == b""
    assert connections == [1, 1]


def test_a_head_answer_has_no_body_whatever_its_length_says(kind: type[Blocking]) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n"
    with scripted(lambda seen: Reply(head) if seen.method == "HEAD" else ok()) as server:
        response, after = kind().run(server.url, [("HEAD", "/", {}), get()])
    assert (response.status_code, response.content) == (200, b"")
    assert response.headers["content-length"] == "9"
    assert after.status_code == 200
    assert [s.connection for s in server.seen] == [1, 1]


def test_a_body_framed_by_the_end_of_the_connection(kind: type[Blocking]) -> None:
    reply = Reply(b"HTTP/1.1 200 OK\r\n\r\nall of it", pieces=3, close=True)
    (response, _), connections = twice(kind, reply)
    assert isinstance(response, httpx.Response)
    assert response.content == b"all of it"
    assert connections == [1, 2]


@pytest.mark.parametrize(
    ("head", "kept"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive\r\ncontent-length: 0\r\n\r\n", True),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n", True),
    ],
    ids=["1.1", "1.1-close", "1.1-keep-alive", "1.0", "1.0-keep-alive"],
)
def test_whether_the_connection_is_kept(kind: type[Blocking], head: bytes, kept: bool) -> None:
    (response, after), connections = twice(kind, Reply(head))
    assert isinstance(response, httpx.Response)
    assert isinstance(after, httpx.Response)
    assert connections == ([1, 1] if kept else [1, 2])


def test_a_compressed_body_is_decoded(kind: type[Blocking]) -> None:
    body = gzip.compress(b'{"x": 1}')
    head = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body)
    (response, _), _ = twice(kind, Reply(head + body))
    assert isinstance(response, httpx.Response)
    assert response.json() == {"x": 1}
    assert response.http_version == "HTTP/1.1"


@pytest.mark.parametrize(
    "data",
    [
        b"SMTP/1.1 200 OK\r\n\r\n",
        b"HTTP/2.0 200 OK\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad name : x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-a: b\r\n folded\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\ncontent-length: 0\n\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nab",  # nothing was pipelined
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\naHTTP/1.1 200 OK\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n",
    ],
    ids=[
        "not-http",
        "http-2.0",
        "status-of-4-digits",
        "header-without-colon",
        "space-before-colon",
        "folded-header",
        "bare-lf",
        "negative-length",
        "two-lengths",
        "transfer-coding-not-chunked",
        "chunked-and-length",
        "bytes-after",
        "a-second-response",
        "bad-chunk-size",
        "chunk-longer-than-its-size",
        "upgrade",
    ],
)
def test_what_is_not_an_http_response_is_refused(kind: type[Blocking], data: bytes) -> None:
    (failed, after), connections = twice(kind, Reply(data), first="/bad")
    assert isinstance(failed, httpx.RemoteProtocolError)
    assert isinstance(after, httpx.Response)
    assert connections == [1, 2]  # the refused connection is not used again


def test_a_head_without_an_end_is_refused_past_the_limit(kind: type[Blocking]) -> None:
    data = b"HTTP/1.1 200 OK\r\nx-filler: " + b"y" * MAX_HEAD  # and then silence
    (failed, _), connections = twice(kind, Reply(data, pieces=4), first="/bad")
    assert isinstance(failed, httpx.RemoteProtocolError)
    assert "longer than" in str(failed)
    assert connections == [1, 2]


@pytest.mark.parametrize(
    "data",
    [b"", b"HTTP/1.1 200 OK\r\n", LENGTH[:-1], CHUNKED[:-2]],
    ids=["nothing", "head", "length-framed", "chunked"],
)
def test_an_end_before_the_response_is_complete_is_refused(
    kind: type[Blocking], data: bytes
) -> None:
    (failed, after), connections = twice(kind, Reply(data, close=True), first="/bad")
    assert isinstance(failed, httpx.RemoteProtocolError)
    assert isinstance(after, httpx.Response)
    assert connections == [1, 2]
