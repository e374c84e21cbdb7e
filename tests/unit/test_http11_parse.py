"""The HTTP/1.1 response parser and request encoder of the SDK's transport (no I/O)."""

from __future__ import annotations

import httpx
import pytest

from qmq_outbox.http11.parse import MAX_HEAD, Parsed, ProtocolError, ResponseParser, request_bytes

LENGTH = (
    b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"a": "bc"}'
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;name=value\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nx-trailer: yes\r\n\r\n"
)


def parse_in_pieces(data: bytes, size: int) -> Parsed:
    """Feed ``data`` ``size`` bytes at a time; exactly the last piece completes it."""
    parser = ResponseParser()
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    for piece in pieces[:-1]:
        assert parser.feed(piece) is None
    parsed = parser.feed(pieces[-1])
    assert parsed is not None
    return parsed


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_a_length_framed_body_in_any_pieces(size: int) -> None:
    parsed = parse_in_pieces(LENGTH, size)
    assert (parsed.status, parsed.reason, parsed.body) == (200, b"OK", b'{"a": "bc"}')
    assert parsed.headers[0] == (b"content-type", b"application/json")
    assert parsed.keep_alive
    assert not parsed.encoded


@pytest.mark.parametrize("size", [1, 2, 5, 13, 10_000])
def test_a_chunked_body_in_any_pieces(size: int) -> None:
    parsed = parse_in_pieces(CHUNKED, size)
    assert parsed.body == b"hello world"
    assert parsed.keep_alive


def test_informational_answers_are_skipped() -> None:
    parsed = ResponseParser().feed(b"HTTP/1.1 100 Continue\r\n\r\n" + LENGTH)
    assert parsed is not None
    assert parsed.status == 200


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
def test_statuses_without_a_body(status: bytes) -> None:
    parsed = ResponseParser().feed(b"HTTP/1.1 " + status + b"\r\n\r\n")
    assert parsed is not None
    assert parsed.body == b""
    assert parsed.keep_alive


def test_a_head_answer_has_no_body_whatever_its_length_says() -> None:
    parsed = ResponseParser(head_only=True).feed(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n")
    assert parsed is not None
    assert parsed.body == b""


def test_a_body_framed_by_the_end_of_the_connection() -> None:
    parser = ResponseParser()
    assert parser.feed(b"HTTP/1.1 200 OK\r\n\r\nall of ") is None
    assert parser.feed(b"it") is None
    parsed = parser.feed_eof()
    assert (parsed.body, parsed.keep_alive) == (b"all of it", False)


@pytest.mark.parametrize(
    ("head", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive\r\ncontent-length: 0\r\n\r\n", True),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n", True),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n",
            False,
        ),
    ],
)
def test_whether_the_connection_can_be_reused(head: bytes, keep_alive: bool) -> None:
    parsed = ResponseParser().feed(head)
    assert parsed is not None
    assert parsed.keep_alive is keep_alive


def test_a_compressed_body_is_marked_and_decoded_by_the_response() -> None:
    import gzip

    body = gzip.compress(b'{"x": 1}')
    head = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body)
    parsed = ResponseParser().feed(head + body)
    assert parsed is not None
    assert parsed.encoded
    response = parsed.response()
    assert response.read() == b'{"x": 1}'
    assert response.extensions["http_version"] == b"HTTP/1.1"


@pytest.mark.parametrize(
    "data",
    [
        b"SMTP/1.1 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad name : x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nab",  # nothing was pipelined
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc\r\n",
    ],
)
def test_what_is_not_an_http_response_is_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        ResponseParser().feed(data)


def test_a_head_without_an_end_is_refused_past_the_limit() -> None:
    parser = ResponseParser()
    assert parser.feed(b"HTTP/1.1 200 OK\r\n") is None
    with pytest.raises(ProtocolError, match="longer than"):
        parser.feed(b"x-filler: " + b"y" * MAX_HEAD)


@pytest.mark.parametrize("data", [b"", b"HTTP/1.1 200 OK\r\n", LENGTH[:-1], CHUNKED[:-2]])
def test_an_end_before_the_response_is_complete_is_refused(data: bytes) -> None:
    parser = ResponseParser()
    if data:
        assert parser.feed(data) is None
    assert parser.started is bool(data)
    with pytest.raises(ProtocolError, match="disconnected"):
        parser.feed_eof()


def test_request_bytes_of_a_post() -> None:
    client = httpx.Client(base_url="http://127.0.0.1:9/base", headers={"x-a": "1"})
    request = client.build_request("POST", "/v1/pull", params={"q": "a b"}, content=b"{}")
    data = request_bytes(request, request.read())
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/v1/pull?q=a+b HTTP/1.1"
    assert b"Host: 127.0.0.1:9" in lines
    assert b"x-a: 1" in lines
    assert [line for line in lines if line.lower().startswith(b"content-length")] == [
        b"Content-Length: 2"
    ]
    assert body == b"{}"


def test_request_bytes_of_a_get_have_no_length() -> None:
    request = httpx.Request("GET", "http://127.0.0.1:9/healthz")
    data = request_bytes(request, request.read())
    assert data.startswith(b"GET /healthz HTTP/1.1\r\n")
    assert data.endswith(b"\r\n\r\n")
    assert b"content-length" not in data.lower()


def test_a_streamed_body_goes_out_with_a_length() -> None:
    request = httpx.Request("POST", "http://127.0.0.1:9/x", content=iter([b"ab", b"cd"]))
    assert request.headers["transfer-encoding"] == "chunked"
    data = request_bytes(request, request.read())
    assert b"transfer-encoding" not in data.lower()
    assert data.endswith(b"Content-Length: 4\r\n\r\nabcd")
