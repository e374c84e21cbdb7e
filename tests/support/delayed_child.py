"""A broker engine in a child process whose wall clock runs ``OFFSET`` seconds ahead.

Coarse schedule buckets are moved hours before their time, which a test cannot wait for;
this child lets it jump there and kill -9 the process mid-move.

``python -m tests.support.delayed_child DATA_DIR OFFSET schedule DAY COUNT BODY_BYTES``
schedules COUNT messages ``m-<i>`` on subject ``orders`` spread evenly over UTC day DAY
(days since the epoch), prints ``scheduled`` and exits.

``python -m tests.support.delayed_child DATA_DIR OFFSET run COUNT`` runs the broker and its
wheel loop, printing ``moved <n>`` whenever the count of moved messages changes, and
``done`` (then exits) once COUNT messages are stored on ``orders`` and nothing waits.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from qmq_broker.clock import SystemClock
from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.engine import Broker
from qmq_broker.format.schedule import HOUR_US
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics

DAY_US = 24 * HOUR_US


class ShiftedClock(SystemClock):
    def __init__(self, offset_us: int) -> None:
        self.offset_us = offset_us

    def wall_us(self) -> int:
        return super().wall_us() + self.offset_us


def message(i: int, due_us: int, body: bytes) -> IncomingMessage:
    return IncomingMessage(
        id=f"m-{i}",
        subject="orders",
        key=None,
        headers={},
        body=body,
        body_base64=False,
        producer="child",
        created_at_us=None,
        deliver_at_us=due_us,
    )


async def schedule(broker: Broker, day: int, count: int, body_bytes: int) -> None:
    body = b"x" * body_bytes
    step = DAY_US // count
    for first in range(0, count, 1000):
        batch = range(first, min(first + 1000, count))
        await broker.services.producer.produce(
            [message(i, day * DAY_US + i * step, body) for i in batch]
        )
    print("scheduled", flush=True)


async def watch(broker: Broker, count: int) -> None:
    sample = broker.metrics.registry.get_sample_value
    last = -1.0
    while True:
        moved = sample("qmq_broker_schedule_moved_messages_total") or 0.0
        if moved != last:
            print(f"moved {int(moved)}", flush=True)
            last = moved
        stored = broker.services.stats.subject("orders").messages
        if stored >= count and broker.services.stats.schedule(limit=1).messages == 0:
            print("done", flush=True)
            return
        await asyncio.sleep(0.001)


async def main(data_dir: Path, offset_s: float, command: str, args: list[str]) -> None:
    broker = Broker(
        BrokerConfig(data_dir=data_dir, fsync=FsyncPolicy(mode="always")),
        metrics=BrokerMetrics(),
        clock=ShiftedClock(round(offset_s * 1_000_000)),
    )
    await broker.start()
    try:
        if command == "schedule":
            await schedule(broker, int(args[0]), int(args[1]), int(args[2]))
        else:
            await watch(broker, int(args[0]))
    finally:
        await broker.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:]))
