"""The SDK's HTTP/1.1 transports over real sockets, against a scripted server.

Each behaviour is checked for the blocking and the asyncio transport alike, through
``httpx.Client`` / ``httpx.AsyncClient`` as a user of a transport sees them.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from qmq_outbox.http11 import AsyncHttp11Transport, Http11Transport
from tests.unit.http_script import (
    KIND_IDS,
    KINDS,
    Blocking,
    Call,
    Reply,
    Seen,
    chunked,
    get,
    ok,
    post,
    scripted,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=KINDS, ids=KIND_IDS)
def kind(request: pytest.FixtureRequest) -> type[Blocking]:
    kind_: type[Blocking] = request.param
    return kind_


def test_requests_reuse_one_kept_alive_connection(kind: type[Blocking]) -> None:
    big = b"b" * 300_000  # more than one read on either side
    with scripted(lambda seen: ok(seen.body or b"{}")) as server:
        answers = kind().run(server.url, [get("/a?x=1"), post("/b", big), get("/c")])
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[1].content == big
    assert [(s.method, s.path, s.connection) for s in server.seen] == [
        ("GET", "/a?x=1", 1),
        ("POST", "/b", 1),
        ("GET", "/c", 1),
    ]
    assert server.seen[1].headers["content-length"] == str(len(big))


def test_a_chunked_answer_read_in_pieces(kind: type[Blocking]) -> None:
    def answer(seen: Seen) -> Reply:
        reply = chunked([b'{"a":', b' "long"', b"}"])
        return Reply(reply.data, pieces=9)

    with scripted(answer) as server:
        (response,) = kind().run(server.url, [get()])
    assert response.json() == {"a": "long"}


def test_connection_close_is_honoured(kind: type[Blocking]) -> None:
    def answer(seen: Seen) -> Reply:
        reply = ok(extra="connection: close\r\n")
        return Reply(reply.data, close=True)

    with scripted(answer) as server:
        answers = kind().run(server.url, [get(), get()])
    assert [a.status_code for a in answers] == [200, 200]
    assert [s.connection for s in server.seen] == [1, 2]


def test_a_connection_the_server_closed_while_idle_is_not_used(kind: type[Blocking]) -> None:
    def answer(seen: Seen) -> Reply:
        return Reply(ok().data, close=seen.path == "/then-close")  # closed without a word

    with scripted(answer) as server:
        calls: list[Call] = [
            get("/then-close"),
            lambda: server.wait_closed(1),
            get("/after"),
            get(),
        ]
        answers = kind().run(server.url, calls)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [s.connection for s in server.seen] == [1, 2, 2]


def test_keepalive_expiry(kind: type[Blocking]) -> None:
    with scripted(lambda seen: ok()) as server:
        user = kind(keepalive_expiry=0.0)
        answers = user.run(server.url, [get(), get()])
    assert [a.status_code for a in answers] == [200, 200]
    assert [s.connection for s in server.seen] == [1, 2]


def test_a_silent_server_times_out_and_its_connection_is_dropped(kind: type[Blocking]) -> None:
    def answer(seen: Seen) -> Reply:
        return Reply(ok().data, delay=1.0 if seen.path == "/slow" else 0.0)

    with scripted(answer) as server:
        slow, after = kind().run(server.url, [get("/slow", timeout=0.2), get("/fast")])
    assert isinstance(slow, httpx.ReadTimeout)
    assert after.status_code == 200
    assert [s.connection for s in server.seen] == [1, 2]


def test_a_response_cut_short_is_a_protocol_error(kind: type[Blocking]) -> None:
    def answer(seen: Seen) -> Reply:
        return Reply(ok(b"0123456789").data[:-4], close=True)

    with scripted(answer) as server:
        (failed,) = kind().run(server.url, [get()])
    assert isinstance(failed, httpx.RemoteProtocolError | httpx.ReadError)


def test_nothing_listening_is_a_connect_error(kind: type[Blocking]) -> None:
    with scripted(lambda seen: ok()) as server:
        url = server.url
    (failed,) = kind().run(url, [get()])
    assert isinstance(failed, httpx.ConnectError)


def test_not_plain_http_is_refused(kind: type[Blocking]) -> None:
    (failed,) = kind().run("https://127.0.0.1:1", [get()])
    assert isinstance(failed, httpx.UnsupportedProtocol)


def test_max_connections_makes_requests_wait_then_time_out() -> None:
    release = threading.Event()

    def answer(seen: Seen) -> Reply:
        if seen.path == "/hold":
            release.wait(10)
        return ok()

    with scripted(answer) as server:
        transport = Http11Transport(limits=httpx.Limits(max_connections=1))
        client = httpx.Client(base_url=server.url, transport=transport)
        holder = threading.Thread(target=client.get, args=("/hold",))
        holder.start()
        while not server.seen:
            time.sleep(0.01)
        with pytest.raises(httpx.PoolTimeout):
            client.get("/waits", timeout=httpx.Timeout(5, pool=0.2))
        waiter_result: list[int] = []
        waiter = threading.Thread(target=lambda: waiter_result.append(client.get("/w").status_code))
        waiter.start()
        time.sleep(0.2)
        assert [s.path for s in server.seen] == ["/hold"]  # still waiting for the one slot
        release.set()
        holder.join(5)
        waiter.join(5)
        client.close()
    assert waiter_result == [200]
    assert [s.path for s in server.seen] == ["/hold", "/w"]


def test_async_max_connections_and_a_cancelled_request() -> None:
    release = threading.Event()

    def answer(seen: Seen) -> Reply:
        if seen.path == "/hold":
            release.wait(10)
        return ok()

    async def main(url: str) -> int:
        transport = AsyncHttp11Transport(limits=httpx.Limits(max_connections=1))
        async with httpx.AsyncClient(base_url=url, transport=transport) as client:
            holder = asyncio.create_task(client.get("/hold"))
            await asyncio.sleep(0.2)
            with pytest.raises(httpx.PoolTimeout):
                await client.get("/waits", timeout=httpx.Timeout(5, pool=0.2))
            holder.cancel()  # gives back its connection slot and closes its connection
            with pytest.raises(asyncio.CancelledError):
                await holder
            response = await client.get("/after")
            return response.status_code

    with scripted(answer) as server:
        status = asyncio.run(main(server.url))
        release.set()
    assert status == 200
    assert [(s.path, s.connection) for s in server.seen] == [("/hold", 1), ("/after", 2)]


def test_the_async_transport_follows_its_client_to_a_new_event_loop() -> None:
    async def one(client: httpx.AsyncClient) -> int:
        return (await client.get("/")).status_code

    with scripted(lambda seen: ok()) as server:
        client = httpx.AsyncClient(base_url=server.url, transport=AsyncHttp11Transport())
        assert asyncio.run(one(client)) == 200
        assert asyncio.run(one(client)) == 200  # the first loop is closed: a new connection
        asyncio.run(client.aclose())
    assert [s.connection for s in server.seen] == [1, 2]


@pytest.mark.parametrize(
    "reply",
    [
        ok(b'{"a": 1}'),
        ok(b'{"error": {"code": "x"}}', status="400 Bad Request"),
        ok(b"", status="503 Service Unavailable", extra="retry-after: 1\r\n"),
        chunked([b"ab", b"cd"]),
        Reply(b"HTTP/1.1 204 No Content\r\nx-y: z\r\n\r\n"),
    ],
    ids=["200", "400", "503", "chunked", "204"],
)
def test_the_same_answers_as_httpx_own_transport(reply: Reply) -> None:
    with scripted(lambda seen: reply) as server:
        ours = Blocking().run(server.url, [post("/x", b"{}")])[0]
        with httpx.Client(base_url=server.url) as client:
            theirs = client.post("/x", content=b"{}")
    assert ours.status_code == theirs.status_code
    assert ours.content == theirs.content
    assert ours.headers.multi_items() == theirs.headers.multi_items()
    assert ours.reason_phrase == theirs.reason_phrase
    assert ours.http_version == theirs.http_version
    assert server.seen[0].headers == server.seen[1].headers


def test_threads_share_the_blocking_transport() -> None:
    with scripted(lambda seen: ok(seen.path.encode())) as server:
        transport = Http11Transport(limits=httpx.Limits(max_connections=3))
        with httpx.Client(base_url=server.url, transport=transport) as client:

            def worker(n: int) -> list[bytes]:
                return [client.get(f"/{n}-{i}").content for i in range(40)]

            results: dict[int, list[bytes]] = {}
            threads = [
                threading.Thread(target=lambda n=n: results.update({n: worker(n)}))
                for n in range(8)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(20)
    assert results == {n: [f"/{n}-{i}".encode() for i in range(40)] for n in range(8)}
    assert server.connections <= 3


def test_tasks_share_the_async_transport() -> None:
    async def main(url: str) -> list[list[bytes]]:
        transport = AsyncHttp11Transport(limits=httpx.Limits(max_connections=3))
        async with httpx.AsyncClient(base_url=url, transport=transport) as client:

            async def worker(n: int) -> list[bytes]:
                return [(await client.get(f"/{n}-{i}")).content for i in range(40)]

            return await asyncio.gather(*(worker(n) for n in range(8)))

    with scripted(lambda seen: ok(seen.path.encode())) as server:
        results = asyncio.run(main(server.url))
    assert results == [[f"/{n}-{i}".encode() for i in range(40)] for n in range(8)]
    assert server.connections <= 3
