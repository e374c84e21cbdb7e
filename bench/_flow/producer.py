"""A producer process: the service's transactions, paced (latency) or flat out (throughput).

Transaction ``i`` inserts business row ``i`` and enqueues one message naming it, in one
transaction; every ``ROLLBACK_EVERY``-th rolls back after both. The commit time is the wall
clock once the transaction's ``with`` block (its COMMIT) has returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

from bench._flow.common import AsyncService, Produced, RolledBack, SyncService, rolls_back
from bench._flow.systems import system

LATE = 0.005  # s after its slot a paced transaction counts as started late


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Process ``first`` of ``stride`` producer processes, ``connections`` at once.

    Paced: transaction i of ``range(first, count, stride)`` starts at ``start + i / rate``.
    Flat out: ids ``first + k * stride`` until ``start + seconds``."""

    first: int
    stride: int
    connections: int
    paced: bool
    rate: float
    count: int
    seconds: float


class _Ids:
    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._lock = threading.Lock()
        self._ids: Iterator[int] = (
            iter(range(plan.first, plan.count, plan.stride))
            if plan.paced
            else (plan.first + k * plan.stride for k in _naturals())
        )

    def next(self, start: float) -> tuple[int, float] | None:
        """(the next id, seconds to wait before it), or None when the plan is done."""
        with self._lock:
            order = next(self._ids, None)
        now = time.monotonic()
        if order is None:
            return None
        if self._plan.paced:
            return order, start + order / self._plan.rate - now
        return (order, 0.0) if now < start + self._plan.seconds else None


def _naturals() -> Iterator[int]:
    k = 0
    while True:
        yield k
        k += 1


class _Tally:
    def __init__(self) -> None:
        self.committed: dict[int, float] = {}
        self.rolled_back: list[int] = []
        self.late = 0
        self.caller_cpu = 0.0
        self._lock = threading.Lock()

    def ran(self, cpu_seconds: float) -> None:
        """A transaction thread's own CPU over the run."""
        with self._lock:
            self.caller_cpu += cpu_seconds

    def produced(self) -> Produced:
        return Produced(
            committed=self.committed,
            rolled_back=self.rolled_back,
            late=self.late,
            finished=time.monotonic(),
            caller_cpu=self.caller_cpu,
        )


def _run_sync(service: SyncService, plan: Plan, start: float) -> Produced:
    ids, tally = _Ids(plan), _Tally()

    def loop() -> None:
        began = time.thread_time()
        try:
            transactions()
        finally:
            tally.ran(time.thread_time() - began)

    def transactions() -> None:
        while (step := ids.next(start)) is not None:
            order, pause = step
            if pause > 0:
                time.sleep(pause)
            elif pause < -LATE:
                tally.late += 1
            try:
                service.transaction(order, rollback=rolls_back(order))
            except RolledBack:
                tally.rolled_back.append(order)
                continue
            tally.committed[order] = time.time()

    threads = [
        threading.Thread(target=loop, name=f"flow-producer-{n}") for n in range(plan.connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally.produced()


async def _run_async(service: AsyncService, plan: Plan, start: float) -> Produced:
    ids, tally = _Ids(plan), _Tally()

    async def loop() -> None:
        while (step := ids.next(start)) is not None:
            order, pause = step
            if pause > 0:
                await asyncio.sleep(pause)
            elif pause < -LATE:
                tally.late += 1
            try:
                await service.transaction(order, rollback=rolls_back(order))
            except RolledBack:
                tally.rolled_back.append(order)
                continue
            tally.committed[order] = time.time()

    await asyncio.gather(*(loop() for _ in range(plan.connections)))
    tally.caller_cpu = math.nan  # one loop thread runs the transactions and the rest
    return tally.produced()


def producer_main(
    name: str,
    db_url: str,
    config: dict[str, str],
    plan: Plan,
    ready: Any,
    go: Any,
    start: Any,
    release: Any,
    results: Any,
) -> None:
    """Build the service, say ready, wait for ``go`` (the first slot is ``start.value``
    on the monotonic clock), run the plan, send the ``Produced``, keep the service (and its
    background work, such as the outbox's dispatcher) running until ``release``."""
    built = system(name).service(db_url, config, plan.connections)
    if inspect.iscoroutinefunction(built.transaction):
        service_async = cast(AsyncService, built)
        asyncio.run(_async_main(service_async, plan, ready, go, start, release, results))
        return
    service = cast(SyncService, built)
    ready.set()
    go.wait()
    results.put(_run_sync(service, plan, start.value))
    release.wait()
    service.close()


async def _async_main(
    service: AsyncService, plan: Plan, ready: Any, go: Any, start: Any, release: Any, results: Any
) -> None:
    await service.warm()
    ready.set()
    await asyncio.to_thread(go.wait)
    results.put(await _run_async(service, plan, start.value))
    await asyncio.to_thread(release.wait)
    await service.close()
