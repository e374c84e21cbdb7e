"""A real broker engine on a real data dir, in-process, for recovery and damage tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.engine import Broker
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics

T = TypeVar("T")


def incoming(i: int, *, subject: str = "orders", body: bytes = b"x" * 100) -> IncomingMessage:
    """Message ``m-<i>`` as the HTTP layer would hand it to the core."""
    return IncomingMessage(
        id=f"m-{i}",
        subject=subject,
        key=None,
        headers={},
        body=body,
        body_base64=False,
        producer="test",
        created_at_us=None,
        deliver_at_us=0,
    )


def run_broker(data_dir: Path, script: Callable[[Broker], Awaitable[T]], **config: Any) -> T:
    """Start a broker (fsync always, ``config`` on top), run ``script``, close it cleanly."""

    async def main() -> T:
        broker = Broker(
            BrokerConfig(data_dir=data_dir, fsync=FsyncPolicy(mode="always"), **config),
            metrics=BrokerMetrics(),
        )
        await broker.start()
        try:
            return await script(broker)
        finally:
            await broker.close()

    return asyncio.run(main())


async def join_ordered(broker: Broker, subject: str, group: str, consumer: str) -> None:
    """Declare ``subject`` ordered with two partitions and let ``consumer`` of ``group``
    take them with a first (empty) ordered pull."""
    await broker.services.routes.declare(subject, partitions=2, on_dead="skip")
    await broker.services.delivery.ack_and_pull(
        ack=None,
        subject=subject,
        group=group,
        consumer=consumer,
        max_messages=1,
        wait_ms=0,
        mode="ordered",
        start="earliest",
    )
