"""What a round trip between two broker processes would cost: input to issue 14's next step.

One core cannot carry produce and pull + ack at 1.2x the PostgreSQL table queue
(docs/benchmarks.md, session 15): the work would be split between front-end processes
(HTTP, decoding, framing, reading) and the one process that owns the storage. Whether that
pays depends on what each request costs the owner to hear about and answer. This measures
it the way such a split would do it: two processes on uvloop, a Unix socket, frames with a
4-byte length prefix, one request in flight at a time, ``--round-trips`` of each shape:

``reserve``  what a produce would ask the owner (16 bytes per message: an id hash and a
             frame length, for 100 messages) and its short answer
``lease``    what a pull's decision would send back (24 bytes per message: seq, attempt,
             position), asked by a short request
``body``     a whole 100 x 1 KiB produce body sent to the owner, which a split that moved
             the bodies would pay

It prints, per round trip, the CPU of each side (``time.process_time`` in each process)
and the wall time.

    .venv/bin/python bench/ipc_cost.py [--round-trips 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

import uvloop

PREFIX = struct.Struct("<I")
WARM_UP = 200  # round trips before the timed ones (the owner's CPU counts them too)
SHAPES = {  # name: (request bytes, answer bytes)
    "reserve": (100 * 16, 64),
    "lease": (64, 100 * 24),
    "body": (100 * 1100, 64),
}


class Framed(asyncio.Protocol):
    """Length-prefixed frames in both directions; ``on_frame`` gets each whole frame."""

    def __init__(self, on_frame: Callable[[Framed, bytes], None]) -> None:
        self._buffer = bytearray()
        self._on_frame = on_frame
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport subclasses

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        buffer = self._buffer
        while len(buffer) >= PREFIX.size:
            (length,) = PREFIX.unpack_from(buffer, 0)
            end = PREFIX.size + length
            if len(buffer) < end:
                break
            frame = bytes(buffer[PREFIX.size : end])
            del buffer[:end]
            self._on_frame(self, frame)

    def send(self, frame: bytes) -> None:
        assert self.transport is not None
        self.transport.write(PREFIX.pack(len(frame)) + frame)


def owner(path: str, answer_bytes: int, ready: Any, done: Any, cpu: Any) -> None:
    """Answer every frame with ``answer_bytes``; report this process's CPU when told."""

    async def serve() -> None:
        answer = b"a" * answer_bytes
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(
            lambda: Framed(lambda peer, _: peer.send(answer)), path
        )
        ready.set()
        began = time.process_time()
        await loop.run_in_executor(None, done.wait)
        cpu.put(time.process_time() - began)
        server.close()

    uvloop.run(serve())


async def front_end(path: str, request_bytes: int, round_trips: int) -> tuple[float, float]:
    """CPU and wall seconds of ``round_trips`` requests, one at a time."""
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[bytes]] = []

    def on_frame(_: Framed, frame: bytes) -> None:
        waiting.pop().set_result(frame)

    transport, peer = await loop.create_unix_connection(lambda: Framed(on_frame), path)
    request = b"q" * request_bytes

    async def one() -> None:
        future = loop.create_future()
        waiting.append(future)
        peer.send(request)
        await future

    for _ in range(WARM_UP):
        await one()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(round_trips):
        await one()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    transport.close()
    return cpu, wall


def measure(shape: str, round_trips: int) -> tuple[float, float, float]:
    """(owner CPU, front-end CPU, wall) per round trip, in seconds."""
    request_bytes, answer_bytes = SHAPES[shape]
    ctx = mp.get_context("spawn")
    ready, done, cpu = ctx.Event(), ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "owner.sock")
        process = ctx.Process(target=owner, args=(path, answer_bytes, ready, done, cpu))
        process.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the owner process did not start")
            front_cpu, wall = uvloop.run(front_end(path, request_bytes, round_trips))
            done.set()
            owner_cpu = cpu.get(timeout=60)
        finally:
            done.set()
            process.join(10)
    # the owner answered the warm-up too; its idle waits cost next to nothing
    return owner_cpu / (round_trips + WARM_UP), front_cpu / round_trips, wall / round_trips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=3000)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"{args.round_trips} round trips per shape; load average {load:.2f} at the start\n")
    print("| shape | request / answer bytes | owner CPU | front-end CPU | wall |")
    print("|---|---|---|---|---|")
    for shape, (request_bytes, answer_bytes) in SHAPES.items():
        owner_s, front_s, wall_s = measure(shape, args.round_trips)
        print(
            f"| {shape} | {request_bytes:,} / {answer_bytes:,} | {owner_s * 1e6:.0f} us "
            f"| {front_s * 1e6:.0f} us | {wall_s * 1e6:.0f} us |"
        )


if __name__ == "__main__":
    main()
