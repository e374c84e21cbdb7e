"""The four workloads, written once against ``Peer`` and timed with a ``Window``."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

from bench._peers.common import Consumer, Peer, Producer, body, index_of
from bench._peers.meter import Cost, Window

TAKE_WAIT = 0.2  # s a draining consumer waits for more before it looks at the count again
DRAIN_TIMEOUT = 60.0  # s end to end waits for stragglers after the last send


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    seconds: float  # durable produce and end to end run this long
    connections: int  # producers of the durable produce (and of the fill before pull + ack)
    batch: int  # messages per produce and per pull
    consumers: int  # consumers of pull + ack
    consume_messages: int  # backlog that pull + ack drains
    single_count: int  # single-message produces timed one by one
    rate: float  # end to end: messages offered per second
    senders: int  # end to end: producer connections the offered load spreads over


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    messages: int
    cost: Cost
    p50_ms: float | None = None
    p99_ms: float | None = None
    lost: int = 0  # end to end: sent but not handled before the drain timeout

    @property
    def rate(self) -> float:
        return self.messages / self.cost.seconds

    @property
    def client_us(self) -> float:
        return self.cost.client_cpu / self.messages * 1e6

    @property
    def server_us(self) -> float:
        return self.cost.server_cpu / self.messages * 1e6


Workload = Callable[[Peer, Settings], Awaitable[Result]]


def percentiles_ms(seconds: list[float]) -> tuple[float, float]:
    if len(seconds) < 2:
        return (seconds[0] * 1000, seconds[0] * 1000) if seconds else (math.nan, math.nan)
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


async def _producers(
    stack: AsyncExitStack, peer: Peer, count: int, *, prime_index: int = 0
) -> list[Producer]:
    """``count`` producers, each connected (clients connect lazily) and primed with one
    message of ``prime_index``, outside the measured stretch."""
    producers = [await stack.enter_async_context(peer.producer()) for _ in range(count)]
    await asyncio.gather(*(producer.send([body(prime_index)]) for producer in producers))
    return producers


async def durable_produce(peer: Peer, settings: Settings) -> Result:
    """``connections`` producers each storing batches of ``batch`` for ``seconds``."""
    bodies = [body(n) for n in range(settings.batch)]

    async def run(producer: Producer, stop_at: float) -> int:
        sent = 0
        while time.perf_counter() < stop_at:
            await producer.send(bodies)
            sent += len(bodies)
        return sent

    async with AsyncExitStack() as stack:
        producers = await _producers(stack, peer, settings.connections)
        with Window(peer.server_processes) as window:
            stop_at = time.perf_counter() + settings.seconds
            sent = await asyncio.gather(*(run(p, stop_at) for p in producers))
    return Result(messages=sum(sent), cost=window.cost)


async def fill(peer: Peer, total: int, settings: Settings) -> None:
    """Store ``total`` messages (not measured) for pull + ack to drain."""

    async def run(producer: Producer, worker: int) -> None:
        step = settings.connections * settings.batch
        for start in range(worker * settings.batch, total, step):
            size = min(settings.batch, total - start)
            await producer.send([body(start + n) for n in range(size)])

    async with AsyncExitStack() as stack:
        producers = [
            await stack.enter_async_context(peer.producer()) for _ in range(settings.connections)
        ]
        await asyncio.gather(*(run(p, n) for n, p in enumerate(producers)))


async def pull_ack(peer: Peer, settings: Settings) -> Result:
    """``consumers`` consumers drain a backlog of ``consume_messages``, ``batch`` at a time;
    the window closes when the last message is acked, not when the idle ones notice."""
    total = settings.consume_messages
    await fill(peer, total, settings)
    acked = 0

    async def run(consumer: Consumer, window: Window) -> None:
        nonlocal acked
        while acked < total:
            bodies = await consumer.take(settings.batch, TAKE_WAIT)
            if bodies:
                await consumer.ack()
                acked += len(bodies)
        await consumer.flush()  # the acks a last pull would have carried
        window.stop()

    async with AsyncExitStack() as stack:
        consumers = [
            await stack.enter_async_context(peer.consumer(prefetch=settings.batch, streaming=False))
            for _ in range(settings.consumers)
        ]
        with Window(peer.server_processes) as window:
            await asyncio.wait_for(
                asyncio.gather(*(run(c, window) for c in consumers)), timeout=_budget(total)
            )
    if acked != total:
        raise RuntimeError(f"{peer.name}: acked {acked} of {total}")
    return Result(messages=total, cost=window.cost)


def _budget(messages: int) -> float:
    """A generous bound (100 msgs/s) so that a stuck system fails the run instead of hanging."""
    return 60 + messages / 100


async def single_produce(peer: Peer, settings: Settings) -> Result:
    """One producer storing one message at a time, each timed."""
    latencies: list[float] = []
    async with AsyncExitStack() as stack:
        (producer,) = await _producers(stack, peer, 1)
        for n in range(min(20, settings.single_count)):  # warm up the path
            await producer.send([body(n)])
        with Window(peer.server_processes) as window:
            for n in range(settings.single_count):
                message = [body(n)]
                began = time.perf_counter()
                await producer.send(message)
                latencies.append(time.perf_counter() - began)
    p50, p99 = percentiles_ms(latencies)
    return Result(messages=settings.single_count, cost=window.cost, p50_ms=p50, p99_ms=p99)


async def end_to_end(peer: Peer, settings: Settings) -> Result:
    """``rate`` messages per second offered for ``seconds`` (open loop, over ``senders``
    connections); latency from each message's scheduled send time to its handler."""
    total = max(2, int(settings.rate * settings.seconds))
    warm = 10  # sent first, indexed past ``total``, not measured
    due = [math.nan] * (total + warm)
    latency = [math.nan] * total
    warmed = asyncio.Event()

    async def consume(consumer: Consumer) -> None:
        handled = warm_seen = 0
        while handled < total:
            bodies = await consumer.take(settings.batch, 1.0)
            for message_body in bodies:  # the handler
                index = index_of(message_body)
                if index < total:
                    latency[index] = time.perf_counter() - due[index]
                    handled += 1
                else:
                    warm_seen += 1
            if bodies:
                await consumer.ack()
            if warm_seen >= warm:
                warmed.set()
        await consumer.flush()

    async def send(pool: asyncio.Queue[Producer], index: int) -> None:
        producer = await pool.get()
        try:
            await producer.send([body(index)])
        finally:
            pool.put_nowait(producer)

    async with AsyncExitStack() as stack:
        pool: asyncio.Queue[Producer] = asyncio.Queue()
        # primed with a warm-up index: the consumer must not count those as measured
        for producer in await _producers(stack, peer, settings.senders, prime_index=total):
            pool.put_nowait(producer)
        consumer = await stack.enter_async_context(
            peer.consumer(prefetch=settings.batch, streaming=True)
        )
        consuming = asyncio.create_task(consume(consumer))
        try:
            for n in range(total, total + warm):
                await send(pool, n)
            await _until(warmed, consuming)
            with Window(peer.server_processes) as window:
                sends = []
                start = time.perf_counter() + 0.01
                for n in range(total):
                    due[n] = start + n / settings.rate
                    delay = due[n] - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    sends.append(asyncio.create_task(send(pool, n)))
                await asyncio.gather(*sends)
                await asyncio.wait({consuming}, timeout=DRAIN_TIMEOUT)
            if consuming.done():
                consuming.result()  # its error, if it had one
        finally:
            consuming.cancel()
            await asyncio.gather(consuming, return_exceptions=True)
    seen = [value for value in latency if not math.isnan(value)]
    p50, p99 = percentiles_ms(seen)
    return Result(
        messages=len(seen), cost=window.cost, p50_ms=p50, p99_ms=p99, lost=total - len(seen)
    )


async def _until(event: asyncio.Event, worker: asyncio.Task[None]) -> None:
    """Wait for ``event``; fail at once with ``worker``'s error if it dies first."""
    waiter = asyncio.create_task(event.wait())
    done, _ = await asyncio.wait(
        {waiter, worker}, timeout=DRAIN_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
    )
    waiter.cancel()
    if worker in done:
        worker.result()
    if waiter not in done:
        raise TimeoutError("the consumer did not receive the warm-up messages")


WORKLOADS: dict[str, Workload] = {
    "produce": durable_produce,
    "consume": pull_ack,
    "single": single_produce,
    "e2e": end_to_end,
}
