"""Blocking callers of an asyncio-only transport: its producer on a private event loop.

nats-py and aio-pika are asyncio libraries; the thread dispatcher and the compensator block.
``BlockingProducer`` runs one ``AsyncProducer`` on a ``LoopThread`` (a named daemon thread
running its own loop) and waits for each ``produce`` there, so the logic exists once.
Several threads may call ``produce`` at once: their batches run concurrently on the loop.
``LoopTransport`` gives such a transport its blocking producer, ``declare()`` and ``check()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from qmq_outbox.dburl import mask_url
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerUnavailable
from qmq_outbox.transports.base import ClosingAsyncProducer, Outcome
from qmq_outbox.transports.topology import Groups, group_pairs

T = TypeVar("T")


def run_blocking(name: str, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on a ``LoopThread`` named ``name`` made for it, then close it."""
    loop = LoopThread(name)
    try:
        return loop.run(coro)
    finally:
        loop.close()


class LoopThread:
    """An event loop on a daemon thread named ``name``, started at once."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (cancelled after ``timeout`` seconds)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop (a library's reader tasks), then stop it."""
        if self._loop.is_closed():
            return
        try:
            self.run(_cancel_the_rest(), timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # stopping anyway
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()


class BlockingProducer:
    """A ``Producer`` made of an ``AsyncProducer`` (made by ``make`` on the loop thread).

    ``timeout`` bounds one ``produce`` (its messages are then all ``BrokerUnavailable``)."""

    def __init__(
        self,
        make: Callable[[], ClosingAsyncProducer],
        *,
        base_url: str,
        name: str,
        timeout: float,
    ) -> None:
        self.base_url = base_url
        self._timeout = timeout
        self._loop = LoopThread(name)
        self._producer = self._loop.run(_made(make))

    def produce(self, messages: Sequence[OutgoingMessage]) -> Sequence[Outcome]:
        try:
            return self._loop.run(self._producer.produce(messages), self._timeout)
        except concurrent.futures.TimeoutError:
            error = BrokerUnavailable(f"{self.base_url}: no answer within {self._timeout:g}s")
            return [error] * len(messages)

    def close(self) -> None:
        try:
            self._loop.run(self._producer.aclose(), self._timeout)
        finally:
            self._loop.close()


class LoopTransport:
    """What the transports over an asyncio library share: a ``BlockingProducer`` of their
    ``async_producer``, and ``declare()``/``check()`` running their ``_declaring()`` /
    ``_probing()`` on a ``LoopThread``. Threads are named ``qmq-<kind>-<what>``."""

    kind: ClassVar[str]
    if TYPE_CHECKING:  # the transport's own fields
        url: str
        publish_timeout: timedelta
        connect_timeout: timedelta
        groups: Groups

    @property
    def base_url(self) -> str:
        return mask_url(self.url)

    def producer(self) -> BlockingProducer:
        budget = self.connect_timeout + 3 * self.publish_timeout
        return BlockingProducer(
            self.async_producer,
            base_url=self.base_url,
            name=f"qmq-{self.kind}-producer",
            timeout=budget.total_seconds(),
        )

    def async_producer(self) -> ClosingAsyncProducer:
        raise NotImplementedError

    @property
    def declared(self) -> tuple[tuple[str, str], ...]:
        """The ``(group, subject)`` pairs of ``groups``."""
        return group_pairs(self.groups)

    def declare(self) -> list[str]:
        """Make what every declared group needs on the server now (again: harmless)."""
        return run_blocking(f"qmq-{self.kind}-declare", self._declaring())

    def check(self) -> None:
        run_blocking(f"qmq-{self.kind}-check", self._probing())

    async def _declaring(self) -> list[str]:
        raise NotImplementedError

    async def _probing(self) -> None:
        raise NotImplementedError


async def _cancel_the_rest() -> None:
    current = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not current]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


async def _made(make: Callable[[], ClosingAsyncProducer]) -> ClosingAsyncProducer:
    return make()  # on the loop: a producer may bind to the running loop when it is made
