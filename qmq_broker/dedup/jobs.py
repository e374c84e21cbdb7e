"""The dedup store's background jobs (``qmq_broker.dedup.store``)::

    job = store.plan()               # loop: None when there is nothing to do
    if job is not None:
        try:
            await asyncio.to_thread(job.run)   # worker thread: the I/O, the arrays
        finally:
            store.commit(job)        # loop: installs the result, or drops a failed job

A job reads the store's state but changes none of it; ``commit`` changes it, on the loop.
One job is outstanding at a time; a failed job's work is planned again. Files are
deleted by a later job, once nothing in the store refers to them.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qmq_broker.dedup.filter import FILTER_FILE, BloomFilter
from qmq_broker.dedup.runs import TEMP_SUFFIX, MappedRun, merge_runs, write_run
from qmq_broker.errors import StorageError
from qmq_broker.storage.fsync import rewrite_file, sync_dir


class DedupJob:
    """Background work a store planned: ``run()`` in a worker thread, then ``commit``.

    ``run()`` does the work once; called again (``flush_all`` finishing a job the caller
    started) it waits for the first call and returns, or raises its error again.
    """

    kind = "job"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._done = False
        self._error: Exception | None = None

    @property
    def done(self) -> bool:
        return self._done

    def run(self) -> None:
        """Do the job's I/O; raises ``StorageError`` when the disk fails it."""
        with self._lock:
            if self._done:
                return
            if self._error is not None:
                raise self._error
            try:
                self._work()
            except OSError as exc:
                self._error = StorageError(f"dedup {self.kind} in {self.directory}: {exc}")
                raise self._error from exc
            except Exception as exc:
                self._error = exc
                raise
            self._done = True

    def _work(self) -> None:
        raise NotImplementedError


class FlushJob(DedupJob):
    """Write the frozen ids as a run, then set their bits in the live filter.

    The bits are set from the worker thread, with no sort: only bits are set, the filter
    is not resized while a job is outstanding, and until ``commit`` the frozen dict still
    answers for these ids, so a lookup meanwhile is right whichever bits it sees.
    """

    kind = "flush"

    def __init__(
        self, directory: Path, *, ids: dict[int, int], horizon: int, bloom: BloomFilter
    ) -> None:
        super().__init__(directory)
        self.ids = ids
        self._horizon = horizon
        self._bloom = bloom
        self.run_written: MappedRun | None = None

    def _work(self) -> None:
        count = len(self.ids)
        hashes = np.fromiter(self.ids.keys(), dtype=np.uint64, count=count)
        seqs = np.fromiter(self.ids.values(), dtype=np.uint64, count=count)
        live = seqs >= np.uint64(self._horizon)
        hashes, seqs = hashes[live], seqs[live]
        header = write_run(self.directory, hashes, seqs)
        if header is not None:
            self.run_written = MappedRun(self.directory / header.name, header)
            self._bloom.insert(hashes)


class MergeJob(DedupJob):
    kind = "merge"

    def __init__(self, directory: Path, *, inputs: tuple[MappedRun, ...], horizon: int) -> None:
        super().__init__(directory)
        self.inputs = inputs
        self._horizon = horizon
        self.merged: MappedRun | None = None

    def _work(self) -> None:
        header = merge_runs(self.directory, self.inputs, horizon=self._horizon)
        if header is not None:
            self.merged = MappedRun(self.directory / header.name, header)


class DeleteJob(DedupJob):
    kind = "delete"

    def __init__(self, directory: Path, *, paths: tuple[Path, ...]) -> None:
        super().__init__(directory)
        self.paths = paths

    def _work(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        sync_dir(self.directory)


class RebuildFilterJob(DedupJob):
    kind = "rebuild-filter"

    def __init__(self, directory: Path, *, runs: tuple[MappedRun, ...], horizon: int) -> None:
        super().__init__(directory)
        self.runs = runs
        self.horizon = horizon
        self.runs_end = max((run.header.end_seq for run in runs), default=0)
        self.built: BloomFilter | None = None

    def _work(self) -> None:
        self.built = filter_of(self.runs, self.horizon)
        save_filter(self.directory, self.built, self.runs_end)


class SaveFilterJob(DedupJob):
    kind = "save-filter"

    def __init__(self, directory: Path, *, bloom: BloomFilter, runs_end: int) -> None:
        super().__init__(directory)
        self._bloom = bloom
        self.runs_end = runs_end

    def _work(self) -> None:
        save_filter(self.directory, self._bloom, self.runs_end)


def filter_of(runs: tuple[MappedRun, ...] | list[MappedRun], horizon: int) -> BloomFilter:
    """A filter sized for, and holding, the live ids of ``runs``."""
    bloom = BloomFilter.sized(sum(run.live_count(horizon) for run in runs))
    for run in runs:
        for hashes in run.live_hashes(horizon):
            bloom.insert(hashes)
    return bloom


def save_filter(directory: Path, bloom: BloomFilter, runs_end: int) -> None:
    path = directory / FILTER_FILE
    temp = path.with_name(path.name + TEMP_SUFFIX)
    header, bits = bloom.encode(runs_end=runs_end)
    rewrite_file(temp, header, bits)
    os.replace(temp, path)
    sync_dir(directory)


SIZE_CLASS_BASE = 4  # a run's size class: floor(log4(count / flush_at)), 0 below 4 x flush_at


def merge_inputs(
    runs: Sequence[MappedRun], *, flush_at: int, fan_in: int, saved_end: int
) -> tuple[MappedRun, ...] | None:
    """The runs to merge next (``fan_in`` of one size class), or None.

    A merge takes runs from one side of what filter.bin holds (``saved_end``), never both:
    on open, the runs past it are read again, and only those.
    """
    classes = [_size_class(run.header.count, flush_at) for run in runs]
    for size_class, side in itertools.product(sorted(set(classes)), (True, False)):
        members = [
            at
            for at, found in enumerate(classes)
            if found == size_class and (runs[at].header.end_seq <= saved_end) == side
        ]
        if len(members) >= fan_in:
            # the newest fan_in of the class, and any run between them, so that the
            # merged run's range covers only its own inputs
            start, stop = members[-fan_in], members[-1] + 1
            return tuple(runs[start:stop])
    return None


def _size_class(count: int, flush_at: int) -> int:
    size_class = 0
    limit = flush_at * SIZE_CLASS_BASE
    while count >= limit:
        size_class += 1
        limit *= SIZE_CLASS_BASE
    return size_class
