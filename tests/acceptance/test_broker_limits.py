"""Bounded resources on a real broker: header and idle timeouts, the connection cap, the pull
caps (per group and broker-wide), abandoned long polls, and the gauges that show them."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.broker_process import BrokerProcess
from tests.support.metrics import metric
from tests.support.waiting import wait_until

JSON = {"content-type": "application/json"}


def http_request(method: str, path: str, body: bytes = b"") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def pull_body(group: str, consumer: str, wait_ms: int) -> bytes:
    doc = {"subject": "orders", "group": group, "consumer": consumer, "wait_ms": wait_ms}
    return orjson.dumps(doc)


def connect(url: str) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return head + b"\r\n\r\n" + body


def seconds_until_closed(sock: socket.socket, began: float, *, trickle: bytes = b"") -> float:
    """Wait for the broker to close ``sock``, sending ``trickle`` a byte every 100 ms."""
    sock.settimeout(0.1)
    for byte in [trickle[i : i + 1] for i in range(len(trickle))] + [b""] * 200:
        if byte:
            try:
                sock.sendall(byte)
            except OSError:
                return time.monotonic() - began
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - began
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - began
    raise AssertionError("the connection was never closed")


@pytest.fixture
def timeouts_broker(broker_factory: type[BrokerProcess], tmp_path: Path) -> str:
    broker = broker_factory(
        tmp_path / "d", extra_args=["--header-timeout", "1500ms", "--idle-timeout", "500ms"]
    ).start()
    return broker.url


def test_a_silent_connection_is_closed_after_the_header_timeout(timeouts_broker: str) -> None:
    url = timeouts_broker
    began = time.monotonic()
    with connect(url) as sock:
        # a fresh connection has the header timeout, not the (shorter) idle timeout
        assert 1.3 <= seconds_until_closed(sock, began) <= 3.0
    assert metric(url, "qmq_broker_connections_timed_out_total", reason="header") == 1


def test_a_request_head_sent_byte_by_byte_is_cut_off_at_the_header_timeout(
    timeouts_broker: str,
) -> None:
    url = timeouts_broker
    head = http_request("GET", "/healthz")[:-2]  # never quite complete
    began = time.monotonic()
    with connect(url) as sock:
        # bytes keep coming every 100 ms, yet the head must be whole within 1.5 s
        assert 1.3 <= seconds_until_closed(sock, began, trickle=head) <= 3.0
    assert metric(url, "qmq_broker_connections_timed_out_total", reason="header") == 1


def test_the_header_timeout_runs_from_the_previous_response(timeouts_broker: str) -> None:
    url = timeouts_broker
    head = http_request("GET", "/healthz")[:-2]  # never quite complete
    with connect(url) as sock:
        time.sleep(1.0)  # most of the header timeout of the connection itself
        sock.sendall(http_request("GET", "/healthz"))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        # the next head's 1.5 s run from the answer, not from the connection's start
        assert 1.3 <= seconds_until_closed(sock, answered, trickle=head) <= 3.0
    assert metric(url, "qmq_broker_connections_timed_out_total", reason="header") == 1


def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout(
    timeouts_broker: str,
) -> None:
    url = timeouts_broker
    with connect(url) as sock:
        sock.sendall(http_request("GET", "/healthz"))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        assert 0.3 <= seconds_until_closed(sock, answered) <= 1.3
    assert metric(url, "qmq_broker_connections_timed_out_total", reason="idle") == 1
    assert metric(url, "qmq_broker_connections_timed_out_total", reason="header") == 0


def test_a_long_poll_is_not_idle(timeouts_broker: str) -> None:
    url = timeouts_broker
    with connect(url) as sock:
        began = time.monotonic()
        sock.sendall(http_request("POST", "/v1/pull", pull_body("g", "c1", 2500)))
        answer = read_response(sock)  # waits past both timeouts on the same connection
        waited = time.monotonic() - began
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert answer.endswith(b'{"messages":[]}')
        assert waited >= 2.4
        # the next request on the same connection is served as usual
        sock.sendall(http_request("GET", "/healthz"))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
    assert metric(url, "qmq_broker_connections_timed_out_total") == 0


def test_connections_beyond_the_cap_are_refused_with_503(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    broker = broker_factory(tmp_path / "d", extra_args=["--max-connections", "4"]).start()
    held = [connect(broker.url) for _ in range(3)]
    try:
        for sock in held:  # each one is accepted and counted: it gets an answer
            sock.sendall(http_request("GET", "/healthz"))
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        with httpx.Client(base_url=broker.url, timeout=5) as http:
            text = http.get("/metrics").text  # the 4th connection, kept open by the client
            assert "qmq_broker_connections_open 4.0" in text
            with connect(broker.url) as extra:  # the 5th: told no at once, then closed
                refused = read_response(extra)
                assert extra.recv(1024) == b""
            late = httpx.get(f"{broker.url}/healthz", timeout=5)  # a client that sends first
            text = http.get("/metrics").text
        assert "qmq_broker_connections_refused_total 2.0" in text
        assert refused.startswith(b"HTTP/1.1 503")
        assert b"retry-after: 1\r\n" in refused
        assert orjson.loads(refused.partition(b"\r\n\r\n")[2])["error"]["code"] == (
            "too_many_connections"
        )
        assert late.status_code == 503
        assert late.headers["retry-after"] == "1"
        assert late.json()["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    # closed connections leave room again
    wait_until(
        lambda: metric(broker.url, "qmq_broker_connections_open") == 1, timeout=10, interval=0.02
    )


async def _post_pull(url: str, group: str, consumer: str, wait_ms: int) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=JSON) as http:
        return await http.post("/v1/pull", content=pull_body(group, consumer, wait_ms))


def test_parked_polls_count_against_the_group_mailbox_and_the_broker_cap(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    broker = broker_factory(
        tmp_path / "d", extra_args=["--mailbox-size", "3", "--max-pending-pulls", "5"]
    ).start()
    url = broker.url

    def parked(count: int) -> None:
        wait_until(
            lambda: metric(url, "qmq_broker_pulls_parked") == count, timeout=15, interval=0.02
        )

    async def scenario() -> None:
        polls = [asyncio.create_task(_post_pull(url, "a", f"c{n}", 20_000)) for n in range(3)]
        await asyncio.to_thread(parked, 3)
        full_group = await _post_pull(url, "a", "c9", 0)
        polls += [asyncio.create_task(_post_pull(url, "b", f"c{n}", 20_000)) for n in range(2)]
        await asyncio.to_thread(parked, 5)
        full_broker = await _post_pull(url, "c", "c9", 0)
        assert full_group.status_code == 429
        assert full_group.headers["retry-after"] == "1"
        assert full_group.json()["error"]["code"] == "mailbox_full"
        assert full_broker.status_code == 429
        assert full_broker.headers["retry-after"] == "1"
        assert full_broker.json()["error"]["code"] == "too_many_pulls"
        assert metric(url, "qmq_broker_pulls_pending") == 5
        assert metric(url, "qmq_broker_actor_parked_requests", group="a") == 3
        assert metric(url, "qmq_broker_actor_rejected_requests_total", group="a") == 1
        assert metric(url, "qmq_broker_pulls_refused_total") == 1
        # the pollers go away: their parked pulls are dropped at once, not in 20 s
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        await asyncio.to_thread(
            wait_until, lambda: metric(url, "qmq_broker_pulls_pending") == 0, 5, 0.02
        )
        assert metric(url, "qmq_broker_pulls_parked") == 0
        room = await _post_pull(url, "c", "c9", 0)
        assert room.status_code == 200

    asyncio.run(scenario())
