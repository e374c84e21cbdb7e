"""Maintenance: checkpoints, retention of old segments, the dedup window and its stores' files.

Three supervised loops run these (``qmq-checkpointer``, ``qmq-retention``, ``qmq-dedup``);
shutdown writes a last checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from qmq_broker.clock import Clock
from qmq_broker.dedup import DedupJob
from qmq_broker.errors import StorageError
from qmq_broker.format.files import SegmentKind, list_segments, segment_number
from qmq_broker.groups import GroupTable
from qmq_broker.memory import malloc_trim
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.storage.checkpoint import Checkpoint
from qmq_broker.storage.index_files import remove_chunk
from qmq_broker.storage.journal import Journal
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectTable

logger = logging.getLogger(__name__)
DEDUP_IDLE_S = 0.2  # how often idle dedup stores are asked for work
DEDUP_RETRY_S = 5.0  # after a job failed (a full disk, say): the ids wait in memory
CHECKPOINT_EVERY_MESSAGES = 200_000  # stored since the last checkpoint: write one now
CHECKPOINT_POLL_S = 0.5


@dataclasses.dataclass(kw_only=True, eq=False)
class Maintenance:
    """Keeps recovery short (checkpoints) and the data directory bounded (retention)."""

    data_dir: Path
    journal: Journal
    subjects: SubjectTable
    groups: GroupTable
    reader: SegmentReader
    clock: Clock
    metrics: BrokerMetrics
    retention_s: float
    dedup_window_s: float
    checkpoint_interval_s: float
    retention_check_interval_s: float

    async def checkpoint(self) -> None:
        """Save group state and index positions so recovery replays only what follows."""
        journal = self.journal
        checkpoint = Checkpoint(
            messages_at=journal.messages.tell(),
            actions_at=journal.actions.tell(),
            groups=self.groups.snapshot(),
            written_at_us=self.clock.wall_us(),
            indexes=self.subjects.index_digests(),
        )
        data_dir = self.data_dir

        def job() -> None:
            journal.fsync_logs()
            journal.fsync_indexes()
            checkpoint.write(data_dir)

        await journal.run_after_flush(job)

    async def checkpoint_loop(self) -> None:
        """A checkpoint every ``checkpoint_interval_s``, and sooner once
        ``CHECKPOINT_EVERY_MESSAGES`` were stored since the last: what recovery scans past
        the checkpoint stays bounded at any produce rate."""
        poll_s = min(self.checkpoint_interval_s, CHECKPOINT_POLL_S)
        last_at, last_count = time.monotonic(), self.subjects.appended
        while True:
            await asyncio.sleep(poll_s)
            stored = self.subjects.appended - last_count
            elapsed = time.monotonic() - last_at
            if elapsed < self.checkpoint_interval_s and stored < CHECKPOINT_EVERY_MESSAGES:
                continue
            last_at, last_count = time.monotonic(), self.subjects.appended
            await self.checkpoint()
            self.metrics.checkpoint_seconds.observe(time.monotonic() - last_at)

    async def retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.retention_check_interval_s)
            await self.apply_retention()

    async def apply_retention(self) -> None:
        """Delete whole segments older than the retention; evict old dedup entries."""
        journal = self.journal
        now = self.clock.wall_us()
        horizon_s = now / 1_000_000 - self.retention_s
        active = journal.messages.segment
        doomed = [
            path
            for path in list_segments(self.data_dir, SegmentKind.MESSAGES)
            if segment_number(path) < active and path.stat().st_mtime < horizon_s
        ]
        checkpointed_actions = Checkpoint.oldest_actions_segment(self.data_dir)
        doomed_actions = [
            path
            for path in list_segments(self.data_dir, SegmentKind.ACTIONS)
            if segment_number(path) < min(checkpointed_actions, journal.actions.segment)
            and path.stat().st_mtime < horizon_s
        ]
        if doomed:
            emptied = self.subjects.drop_segments_before(segment_number(doomed[-1]) + 1)
            for path in doomed:
                self.reader.forget(segment_number(path))
                path.unlink()
            # The checkpoint records the new first seqs and byte counts before the index
            # chunks they leave behind go, so recovery never needs a deleted chunk.
            await self.checkpoint()
            for subject, start in emptied:
                self.subjects.reader.forget(subject, start)
                remove_chunk(self.data_dir, subject, start)
            logger.info(
                "retention removed segments",
                extra={
                    "action": "broker.retention",
                    "segments": [p.name for p in doomed],
                    "index_chunks": len(emptied),
                },
            )
        for path in doomed_actions:
            path.unlink()
        self.subjects.evict_dedup(now - int(self.dedup_window_s * 1_000_000))

    async def dedup_loop(self) -> None:
        """Write the dedup stores' recent ids into runs, merge runs, keep filters: each
        store's background work, one job at a time, on a worker thread."""
        while True:
            try:
                worked = await self.dedup_step()
            except StorageError:
                # The store is unchanged by a failed job and plans it again: retry later.
                logger.error(
                    "dedup store job failed", extra={"action": "broker.dedup_failed"}, exc_info=True
                )
                await asyncio.sleep(DEDUP_RETRY_S)
                worked = False
            if not worked:
                for store in self.subjects.dedup_stores():
                    store.release_pages()  # what lookups mapped in since the last tick
                await asyncio.sleep(DEDUP_IDLE_S)

    async def dedup_step(self) -> bool:
        """Run the next job of every dedup store that has one; whether any had."""
        worked = False
        for store in self.subjects.dedup_stores():
            job = store.plan()
            if job is None:
                continue
            running = asyncio.ensure_future(asyncio.to_thread(_run_and_trim, job))
            try:
                await asyncio.shield(running)
            finally:
                if not running.done():
                    # Cancelled (the broker is closing), but the thread runs on: the store
                    # must not change, nor close and write its own files, until it is done.
                    await asyncio.wait([running])
                    if not running.cancelled():
                        running.exception()  # seen here; commit drops a failed job
                store.commit(job)
                store.release_pages()
            worked = True
        return worked


_TRIM = malloc_trim()


def _run_and_trim(job: DedupJob) -> None:
    """A dedup job, then the big arrays it freed given back to the OS (glibc keeps them
    in its heap otherwise: a merge or a filter rebuild of millions of ids)."""
    job.run()
    if _TRIM is not None and job.kind in ("merge", "rebuild-filter"):
        _TRIM()
