"""Time-based retention of whole segments, with a clock that can jump forward."""

from __future__ import annotations

import asyncio
from pathlib import Path

from qmq_broker.clock import SystemClock
from qmq_broker.config import BrokerConfig
from qmq_broker.engine import Broker
from qmq_broker.format import SegmentKind, list_segments
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics


def message(i: int) -> IncomingMessage:
    return IncomingMessage(
        id=f"m-{i}",
        subject="orders",
        key=None,
        headers={},
        body=b"x" * 1000,
        body_base64=False,
        producer=None,
        created_at_us=None,
        deliver_at_us=0,
    )


class SkewedClock(SystemClock):
    """The system clock, moved ahead by ``skew_us`` (retention judges by wall time)."""

    skew_us = 0

    def wall_us(self) -> int:
        return super().wall_us() + self.skew_us


def test_old_segments_are_deleted_whole_and_groups_skip_ahead(tmp_path: Path) -> None:
    clock = SkewedClock()

    async def scenario() -> None:
        config = BrokerConfig(
            data_dir=tmp_path, segment_bytes=16 * 1024, retention_s=3600, dedup_window_s=4 * 3600
        )
        broker = Broker(config, metrics=BrokerMetrics(), clock=clock)
        await broker.start()
        try:
            await broker.services.producer.produce([message(i) for i in range(60)])
            first, _ = await broker.services.delivery.ack_and_pull(
                ack=None,
                subject="orders",
                group="g",
                consumer="c",
                max_messages=1,
                wait_ms=0,
                mode="shared",
                start="earliest",
            )
            assert first[0]["seq"] == 0
            before = broker.services.stats.subject("orders")
            segments = list_segments(tmp_path, SegmentKind.MESSAGES)
            assert len(segments) > 2

            await broker.services.maintenance.apply_retention()  # nothing is old yet
            assert list_segments(tmp_path, SegmentKind.MESSAGES) == segments

            clock.skew_us = 2 * 3600 * 1_000_000
            await broker.services.maintenance.apply_retention()
            left = list_segments(tmp_path, SegmentKind.MESSAGES)
            assert left == segments[-1:]  # the active segment stays
            after = broker.services.stats.subject("orders")
            assert after.first_seq > 0
            assert after.messages == 60 - after.first_seq
            assert after.bytes < before.bytes
            assert (
                broker.services.delivery.dead_letters(
                    subject="orders", group="g", limit=10, after_seq=None
                ).dead
                == []
            )
            nxt, _ = await broker.services.delivery.ack_and_pull(
                ack=None,
                subject="orders",
                group="g",
                consumer="c",
                max_messages=1,
                wait_ms=0,
                mode="shared",
                start="earliest",
            )
            assert nxt[0]["seq"] == after.first_seq
            # seq 0 was leased before retention removed it: it is dead, and says why
            (dead,) = broker.services.delivery.dead_letters(
                subject="orders", group="g", limit=10, after_seq=None
            ).dead
            assert (dead.seq, dead.message) == (0, None)
            assert dead.error == "removed by retention before it was acknowledged"
            # dedup still answers within its window even though the record is gone
            again = await broker.services.producer.produce([message(0)])
            assert again[0]["status"] == "duplicate"
        finally:
            await broker.close()

    asyncio.run(scenario())
