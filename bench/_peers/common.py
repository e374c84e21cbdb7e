"""What every peer offers the workloads, and the bodies the workloads send."""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Generic, Protocol, TypeVar

import psutil

BODY_SIZE = 1024
_INDEX_DIGITS = 20

T = TypeVar("T")


def body(index: int) -> bytes:
    """A 1 KiB body that starts with ``index`` (end to end finds its send time by it)."""
    return f"{index:0{_INDEX_DIGITS}d}".encode().ljust(BODY_SIZE, b"x")


def index_of(message_body: bytes) -> int:
    return int(message_body[:_INDEX_DIGITS])


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by``: round n runs the systems in the order rotated by n,
    so that drift hits each of them in every place."""
    shift = by % len(items)
    return [*items[shift:], *items[:shift]]


class Producer(Protocol):
    """One connection that stores messages."""

    async def send(self, bodies: Sequence[bytes]) -> None:
        """Store ``bodies`` as durably as the system offers; return once it confirmed."""


class Consumer(Protocol):
    """One connection that leases messages and acknowledges them."""

    async def take(self, max_messages: int, wait: float) -> list[bytes]:
        """Up to ``max_messages`` bodies, waiting at most ``wait`` s for the first; [] if none."""

    async def ack(self) -> None:
        """Acknowledge everything the last ``take`` returned: at once, or with the next
        ``take`` where the system's client carries acks on pulls (then ``flush`` sends
        what is left)."""

    async def flush(self) -> None:
        """Send acknowledgements still held for the next ``take``, if any."""


class Peer(Protocol):
    """A queueing system under test: one queue, emptied between workloads."""

    name: str  # key on the command line and in the JSON
    title: str  # column heading in the tables

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def reset(self) -> None:
        """An empty queue (and no consumer state) for the next workload."""

    def producer(self) -> AbstractAsyncContextManager[Producer]: ...

    def consumer(self, *, prefetch: int, streaming: bool) -> AbstractAsyncContextManager[Consumer]:
        """A consumer; ``streaming``: messages arrive while it runs (end to end), rather than
        a backlog to drain, for systems whose client has a different idiom for each."""

    def server_processes(self) -> list[psutil.Process]:
        """The processes whose CPU counts as the server's (looked up at each call)."""

    def notes(self) -> list[str]:
        """Version and durability settings, known after ``start``."""


def processes_named(name: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]


class Inbox(Generic[T]):
    """Messages a push-style client delivered, taken in batches like a pull."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[T] = asyncio.Queue()

    def put(self, item: T) -> None:
        self._queue.put_nowait(item)

    async def take(self, max_items: int, wait: float) -> list[T]:
        try:
            first = await asyncio.wait_for(self._queue.get(), wait)
        except TimeoutError:
            return []
        items = [first]
        while len(items) < max_items and not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items


def version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"
