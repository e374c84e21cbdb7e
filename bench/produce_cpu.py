"""CPU per message of the broker's produce path, in process: request bytes -> answer bytes.

No sockets and no client: the broker's own Starlette app is called as an ASGI app with a
hand-built request (the same scope uvicorn hands it), on uvloop like the server, with
``--fsync never`` so that the disk is out of the picture. Every stage is timed with
``time.process_time()`` (all threads: the journal's writer thread counts too) and with
``time.thread_time()`` of the event-loop thread alone, per message, best of ``--repeat``:

``app``     the whole request: guard middleware, routing, body, decode + validate, the
            messages handed to the core, produce, the JSON answer
``decode``  decode + validate the request body alone
``convert`` decode + validate and build the core's incoming messages (the HTTP layer's part)
``core``    ``ProduceService.produce`` on ready messages (dedup, framing, journal, index)

Each request holds ``--batch`` envelopes of ``--body-bytes`` bytes with new ids, the shape
of issue 14's throughput workload (1 KiB x 100). ``--profile`` runs the ``app`` stage under
cProfile and prints the functions with the most time of their own.

    .venv/bin/python bench/produce_cpu.py
    .venv/bin/python bench/produce_cpu.py --requests 300 --repeat 7 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import os
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.engine import Broker
from qmq_broker.http import bodies
from qmq_broker.http.app import create_app
from qmq_broker.http.incoming import incoming_messages
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics

SUBJECT = "bench.produce"
STAMP = "2026-11-22T10:00:00.123456Z"


def request_body(tag: str, *, batch: int, body_bytes: int) -> bytes:
    """One produce body of ``batch`` envelopes, every id new."""
    body = "x" * body_bytes
    return orjson.dumps(
        {
            "messages": [
                {
                    "id": f"{tag}-{i}",
                    "subject": SUBJECT,
                    "body": body,
                    "producer": "bench",
                    "created_at": STAMP,
                }
                for i in range(batch)
            ]
        }
    )


class AsgiCaller:
    """Calls the app as uvicorn would: one POST with the whole body in one message."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8080),
        }
        sent = False
        status = 0
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self._app(scope, receive, send)
        return status, b"".join(chunks)


# --- the stages --------------------------------------------------------------------------
# A stage prepares one request outside the timing (so that its input is fresh in the cache,
# as a body just read from a socket is) and then does its timed work on it.


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    name: str
    prepare: Callable[[bytes], Any]
    run: Callable[[Any], Awaitable[None]]


def incoming(broker: Broker, raw: bytes) -> list[IncomingMessage]:
    """What the produce route hands the core for one request body (auth off)."""
    envelopes = bodies.decode(raw, bodies.ProduceBody).messages
    return incoming_messages(
        envelopes,
        now_us=broker.clock.wall_us(),
        max_body_bytes=broker.config.max_body_bytes,
        max_delay_s=broker.config.max_delay_s,
    )


def stages(broker: Broker, caller: AsgiCaller) -> list[Stage]:
    async def decode(raw: bytes) -> None:
        bodies.decode(raw, bodies.ProduceBody)

    async def convert(raw: bytes) -> None:
        incoming(broker, raw)

    async def core(messages: list[IncomingMessage]) -> None:
        await broker.services.producer.produce(messages)

    async def app(raw: bytes) -> None:
        status, answer = await caller.post("/v1/messages", raw)
        if status != 200:
            raise RuntimeError(f"produce answered {status}: {answer[:300]!r}")

    def same(raw: bytes) -> bytes:
        return raw

    return [
        Stage(name="decode", prepare=same, run=decode),
        Stage(name="convert", prepare=same, run=convert),
        Stage(name="core", prepare=lambda raw: incoming(broker, raw), run=core),
        Stage(name="app", prepare=same, run=app),
    ]


async def timed(stage: Stage, *, tag: str, args: argparse.Namespace) -> tuple[float, float]:
    """(process CPU s, event-loop thread CPU s) of one stage over ``args.requests`` requests."""
    gc.collect()
    cpu = thread = 0.0
    for number in range(args.requests):
        prepared = stage.prepare(
            request_body(f"{tag}-{number}", batch=args.batch, body_bytes=args.body_bytes)
        )
        began_cpu, began_thread = time.process_time(), time.thread_time()
        await stage.run(prepared)
        cpu += time.process_time() - began_cpu
        thread += time.thread_time() - began_thread
    return cpu, thread


async def bench(args: argparse.Namespace) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="qmq-produce-cpu-"))
    config = BrokerConfig(data_dir=data_dir, fsync=FsyncPolicy(mode="never"))
    broker = Broker(config, metrics=BrokerMetrics())
    await broker.start()
    caller = AsgiCaller(create_app(broker))
    best: dict[str, tuple[float, float]] = {}
    try:
        for repeat in range(args.repeat):
            for stage in stages(broker, caller):
                cpu, thread = await timed(stage, tag=f"{stage.name}{repeat}", args=args)
                old_cpu, old_thread = best.get(stage.name, (cpu, thread))
                best[stage.name] = (min(cpu, old_cpu), min(thread, old_thread))
        report(best, args)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await timed(stages(broker, caller)[-1], tag="profile", args=args)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    finally:
        await broker.close()
        shutil.rmtree(data_dir, ignore_errors=True)


def report(best: dict[str, tuple[float, float]], args: argparse.Namespace) -> None:
    count = args.requests * args.batch
    print(
        f"produce path, {args.batch} x {args.body_bytes} B per request, {args.requests} "
        f"requests, best of {args.repeat}; fsync never; load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'stage':<10} {'process us/msg':>15} {'loop thread us/msg':>19}")
    for name, (cpu, thread) in best.items():
        print(f"{name:<10} {1e6 * cpu / count:>15.2f} {1e6 * thread / count:>19.2f}")
    rest = best["app"][0] - best["convert"][0] - best["core"][0]
    print(f"{'rest':<10} {1e6 * rest / count:>15.2f}   (app - convert - core: Starlette, answer)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per repeat")
    parser.add_argument("--batch", type=int, default=100, help="envelopes per request")
    parser.add_argument("--body-bytes", type=int, default=1024, help="body size")
    parser.add_argument("--repeat", type=int, default=5, help="repeats; the best counts")
    parser.add_argument("--profile", action="store_true", help="cProfile the app stage")
    parser.add_argument("--top", type=int, default=25, help="functions --profile prints")
    args = parser.parse_args()
    uvloop.run(bench(args))


if __name__ == "__main__":
    main()
