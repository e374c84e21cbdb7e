"""A dedup job still running on its thread when the broker closes: the maintenance loop waits
for it before the store changes, so the close does not write the same files beside it.

A real ``DedupStore`` on a real directory; the job is slowed down so that the cancel lands
while it runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from qmq_broker import maintenance
from qmq_broker.dedup import DedupStore
from qmq_broker.dedup.runs import RUN_SUFFIX


class OneStore:
    """What ``Maintenance.dedup_step`` asks of the subject table."""

    def __init__(self, store: DedupStore) -> None:
        self.store = store

    def dedup_stores(self) -> list[DedupStore]:
        return [self.store]


def test_closing_while_a_dedup_job_runs_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DedupStore.open(tmp_path, flush_at=1000)
    store.add_many(list(range(1, 1501)), 0)  # past flush_at: a flush is planned
    finished = threading.Event()
    real = maintenance._run_and_trim

    def slow(job: Any) -> None:
        time.sleep(0.3)
        real(job)
        finished.set()

    monkeypatch.setattr(maintenance, "_run_and_trim", slow)
    keeper = maintenance.Maintenance.__new__(maintenance.Maintenance)  # only dedup_step is used
    keeper.subjects = OneStore(store)  # type: ignore[assignment]

    async def main() -> None:
        step = asyncio.create_task(keeper.dedup_step())
        await asyncio.sleep(0.05)  # the job is on its thread now
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert finished.is_set(), "the cancelled step returned before its job was done"

    asyncio.run(main())
    store.close()  # what the broker's close does next: no second writer of the same run
    runs = [p for p in tmp_path.iterdir() if p.name.endswith(RUN_SUFFIX)]
    assert runs
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    reopened = DedupStore.open(tmp_path, flush_at=1000)
    assert reopened.find_many([1, 1500]) == [0, 1499]
    reopened.close()
