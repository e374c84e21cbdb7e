"""Where a single-message produce's latency goes: the HTTP floor, the broker's work, the fsync.

Issue 14 asks for a single-message produce at p50 0.35 ms. This splits the broker's figure
into what any server on the same stack would cost and what the broker adds, by timing the
same request from the project's clients (``AsyncBrokerClient`` on asyncio's default loop,
and the blocking ``BrokerClient``; one connection, one message of 1 KiB at a time, each
timed) against four servers, in rounds with the order rotated:

``httptools``      a bare asyncio protocol on uvloop parsing with httptools, answering a
                   canned produce answer: the floor of this client, the kernel and the VM
``uvicorn``        a bare ASGI app under uvicorn (uvloop, httptools) answering the same:
                   the floor of the server stack the broker runs on
``broker-never``   ``qmq broker --fsync never``: the broker's own work on top of uvicorn
``broker-always``  ``qmq broker --fsync always`` (the default): and the fdatasync

It prints per server and client the p50 / p99, the client's CPU and the server process's
CPU per request (psutil, so approximate), and the per-round differences that isolate the
broker's work (``broker-never`` - ``uvicorn``) and the fsync (``broker-always`` -
``broker-never``). The bare uvicorn app's answer goes out in two writes (head, body), as
uvicorn sends it; the broker joins them into one, so its difference to it is, if anything,
understated.

    .venv/bin/python bench/single_floor.py [--rounds 3] [--requests 5000] [--clients async,sync]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._broker import BenchBroker, free_port
from bench._peers.common import rotated
from bench._peers.meter import Cost, Window
from bench._peers.workloads import percentiles_ms
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.envelope import OutgoingMessage

SERVERS = ("httptools", "uvicorn", "broker-never", "broker-always")
CLIENTS = ("async", "sync")
ANSWER = b'{"results":[{"id":"x","subject":"floor","status":"stored","seq":1}]}'
WARM_UP = 50
BODY = b"x" * 1024


def serve_bare(kind: str, port: int) -> None:
    """Run a bare server answering every request with ``ANSWER`` (the child process)."""
    import uvloop

    if kind == "uvicorn":
        import uvicorn

        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": ANSWER})

        uvicorn.run(
            app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
            access_log=False, log_level="warning",
        )  # fmt: skip
        return

    import httptools

    response = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    response %= (len(ANSWER), ANSWER)

    class Bare(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_complete(self) -> None:
            self.transport.write(response)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Bare, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


class Server:
    """One of ``SERVERS`` as a subprocess, serving at ``url`` once ``start()`` returned."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        self._root = root
        self._broker: BenchBroker | None = None
        self._bare: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> psutil.Process:
        if self.kind.startswith("broker-"):
            fsync = self.kind.removeprefix("broker-")
            self._broker = BenchBroker(self._root / f"data-{time.monotonic_ns()}", "--fsync", fsync)
            self._broker.start()
            self.url = self._broker.url
            assert self._broker.proc is not None
            return psutil.Process(self._broker.proc.pid)
        port = free_port()
        self._bare = subprocess.Popen(
            [sys.executable, __file__, "--serve", self.kind, "--port", str(port)]
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._bare.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self._bare.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                time.sleep(0.05)
                continue
            return psutil.Process(self._bare.pid)
        raise TimeoutError(f"{self.kind} did not listen")

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._bare is not None:
            self._bare.terminate()
            self._bare.wait(timeout=10)
            self._bare = None


def message(n: int, prefix: str) -> list[OutgoingMessage]:
    return [OutgoingMessage(id=f"{prefix}-{n}", subject="floor", body=BODY)]


async def time_async(url: str, requests: int, server: psutil.Process) -> dict[str, float]:
    latencies: list[float] = []
    async with AsyncBrokerClient(url, max_connections=1) as client:
        for n in range(WARM_UP):
            await client.produce(message(n, "async-warm"))
        with Window(lambda: [server]) as window:
            for n in range(requests):
                request = message(n, "async")
                began = time.perf_counter()
                await client.produce(request)
                latencies.append(time.perf_counter() - began)
    return summary(latencies, window.cost)


def time_sync(url: str, requests: int, server: psutil.Process) -> dict[str, float]:
    latencies: list[float] = []
    with BrokerClient(url, max_connections=1) as client:
        for n in range(WARM_UP):
            client.produce(message(n, "sync-warm"))
        with Window(lambda: [server]) as window:
            for n in range(requests):
                request = message(n, "sync")
                began = time.perf_counter()
                client.produce(request)
                latencies.append(time.perf_counter() - began)
    return summary(latencies, window.cost)


def summary(latencies: list[float], cost: Cost) -> dict[str, float]:
    p50_ms, p99_ms = percentiles_ms(latencies)
    return {
        "p50_ms": p50_ms,
        "p99_ms": p99_ms,
        "client_us": cost.client_cpu / len(latencies) * 1e6,
        "server_us": cost.server_cpu / len(latencies) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=5000, help="timed per run")
    parser.add_argument("--clients", default="async,sync", help="of: " + ", ".join(CLIENTS))
    parser.add_argument("--serve", choices=("uvicorn", "httptools"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_bare(args.serve, args.port)
        return
    clients = [c for c in args.clients.split(",") if c]
    if args.rounds < 1 or args.requests < 100 or not clients or set(clients) - set(CLIENTS):
        parser.error("--rounds 1 or more, --requests 100 or more, --clients of async, sync")
    load0 = os.getloadavg()
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for round_no in range(args.rounds):
            for kind in rotated(SERVERS, round_no):
                server = Server(kind, Path(root))
                process = server.start()
                try:
                    for client in clients:
                        if client == "async":
                            result = asyncio.run(time_async(server.url, args.requests, process))
                        else:
                            result = time_sync(server.url, args.requests, process)
                        results.setdefault((kind, client), []).append(result)
                        print(
                            f"round {round_no + 1} {kind:14} {client:5} p50"
                            f" {result['p50_ms']:.3f} ms, p99 {result['p99_ms']:.3f} ms; CPU per"
                            f" request: client {result['client_us']:.0f} us, server"
                            f" {result['server_us']:.0f} us",
                            flush=True,
                        )
                finally:
                    server.stop()
    load1 = os.getloadavg()
    print(
        f"\n`python bench/single_floor.py --rounds {args.rounds} --requests {args.requests}"
        f" --clients {','.join(clients)}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())};"
        f" load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end\n"
    )
    print("| server | client | p50 ms | p99 ms | client CPU us | server CPU us |")
    print("|---|---|---|---|---|---|")
    for kind in SERVERS:
        for client in clients:
            rows = results[kind, client]
            cells = [statistics.median(r[key] for r in rows) for key in
                     ("p50_ms", "p99_ms", "client_us", "server_us")]  # fmt: skip
            print(
                f"| {kind} | {client} | {cells[0]:.3f} | {cells[1]:.3f} | {cells[2]:.0f} |"
                f" {cells[3]:.0f} |"
            )
    print("\n| p50 difference, ms, per round | client | " + " | ".join(
        f"round {n + 1}" for n in range(args.rounds)) + " |")  # fmt: skip
    print("|---|---|" + "---|" * args.rounds)
    for label, high, low in (
        ("uvicorn - httptools (the ASGI server)", "uvicorn", "httptools"),
        ("broker-never - uvicorn (the broker's work)", "broker-never", "uvicorn"),
        ("broker-always - broker-never (the fsync)", "broker-always", "broker-never"),
    ):
        for client in clients:
            pairs = zip(results[high, client], results[low, client], strict=True)
            diffs = [f"{above['p50_ms'] - below['p50_ms']:.3f}" for above, below in pairs]
            print(f"| {label} | {client} | " + " | ".join(diffs) + " |")


if __name__ == "__main__":
    main()
