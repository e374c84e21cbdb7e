"""The dedup window's edge, live and across restarts, with the subject's dedup store.

An id stored just inside the window answers ``duplicate`` with its seq; one stored just
outside is stored again. The clock is the system clock moved ahead (stored times, the
window and recovery all read it).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from qmq_broker.config import BrokerConfig
from qmq_broker.engine import Broker
from qmq_broker.metrics import BrokerMetrics
from tests.support.engine import incoming
from tests.unit.test_retention import SkewedClock

WINDOW_S = 3600
MINUTE_US = 60 * 1_000_000


def run(data_dir: Path, clock: SkewedClock, script: Any) -> Any:
    async def main() -> Any:
        config = BrokerConfig(data_dir=data_dir, dedup_window_s=WINDOW_S)
        broker = Broker(config, metrics=BrokerMetrics(), clock=clock)
        await broker.start()
        try:
            return await script(broker)
        finally:
            await broker.close()

    return asyncio.run(main())


async def produce(broker: Broker, numbers: range | list[int]) -> list[tuple[str, int | None]]:
    answers = await broker.services.producer.produce([incoming(n) for n in numbers])
    return [(a["status"], a["seq"]) for a in answers]


def test_an_id_just_inside_the_window_is_a_duplicate_and_one_just_outside_is_stored(
    tmp_path: Path,
) -> None:
    clock = SkewedClock()

    async def fill(broker: Broker) -> None:
        assert await produce(broker, range(100)) == [("stored", n) for n in range(100)]
        clock.skew_us += 2 * MINUTE_US
        assert await produce(broker, range(100, 200)) == [("stored", n) for n in range(100, 200)]

    run(tmp_path, clock, fill)
    # one minute past the window of the first hundred, one minute inside the second's
    clock.skew_us += (WINDOW_S - 1) * 1_000_000 - MINUTE_US

    async def live(broker: Broker) -> list[tuple[str, int | None]]:
        # moves the window (retention keeps all)
        await broker.services.maintenance.apply_retention()
        return await produce(broker, [5, 150])

    assert run(tmp_path, clock, live) == [("stored", 200), ("duplicate", 150)]

    async def after_restart(broker: Broker) -> list[tuple[str, int | None]]:
        return await produce(broker, [6, 151, 5])

    # recovery sets the window from the clock too: 6 is outside, 151 inside, 5 was stored
    # again a moment ago (seq 200), inside
    assert run(tmp_path, clock, after_restart) == [
        ("stored", 201),
        ("duplicate", 151),
        ("duplicate", 200),
    ]


def test_ids_of_every_dedup_layer_answer_after_restarts(tmp_path: Path) -> None:
    """Ids in runs written by the dedup loop's flushes and in the run written at close
    all answer, restart after restart."""
    clock = SkewedClock()
    total = 40_000  # two flushes of 16,384 ids, then the rest written at close

    async def fill(broker: Broker) -> None:
        for first in range(0, total, 1000):
            await produce(broker, range(first, first + 1000))
        for _ in range(50):  # let the dedup loop flush what is due
            if not await broker.services.maintenance.dedup_step():
                break

    run(tmp_path, clock, fill)
    sample = [0, 1, 16_383, 16_384, 30_000, total - 1]
    for _ in range(2):
        assert run(tmp_path, clock, lambda b: produce(b, sample)) == [
            ("duplicate", n) for n in sample
        ]
    runs = sorted((tmp_path / "dedup" / "orders").glob("*.run"))
    assert runs != []


def test_one_request_with_old_ids_new_ids_and_an_id_twice(tmp_path: Path) -> None:
    """A batch big enough for the vectorised lookup: ids in runs answer duplicate with
    their seqs, new ones are stored, and an id given twice is stored once."""
    clock = SkewedClock()

    async def fill(broker: Broker) -> None:
        await produce(broker, range(20_000))

    run(tmp_path, clock, fill)  # closing writes the dedup store's runs
    old = list(range(0, 20_000, 1_000))
    numbers = [*old, 30_000, 30_001, 30_000, *range(30_002, 30_010)]
    answers = run(tmp_path, clock, lambda b: produce(b, numbers))
    assert answers[: len(old)] == [("duplicate", n) for n in old]
    assert answers[len(old) :] == [
        ("stored", 20_000),
        ("stored", 20_001),
        ("duplicate", 20_000),
        *[("stored", 20_002 + i) for i in range(8)],
    ]


def test_one_request_over_two_subjects_with_an_id_twice_in_each(tmp_path: Path) -> None:
    clock = SkewedClock()

    async def script(broker: Broker) -> list[tuple[str, int | None]]:
        await produce(broker, range(3))  # orders 0..2
        batch = [
            incoming(1),  # stored before: duplicate
            incoming(7, subject="refunds"),
            incoming(8),
            incoming(7, subject="refunds"),  # twice in this request
            incoming(8),  # twice in this request
            incoming(8, subject="refunds"),  # same id, another subject: its own
        ]
        answers = await broker.services.producer.produce(batch)
        return [(a["status"], a["seq"]) for a in answers]

    assert run(tmp_path, clock, script) == [
        ("duplicate", 1),
        ("stored", 0),
        ("stored", 3),
        ("duplicate", 0),
        ("duplicate", 3),
        ("stored", 1),
    ]
