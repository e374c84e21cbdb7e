"""The request bytes the SDK's HTTP/1.1 transports write (no I/O; what they read is
checked over sockets in ``test_http11_framing.py``)."""

from __future__ import annotations

import httpx

from qmq_outbox.http11.parse import request_bytes


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
