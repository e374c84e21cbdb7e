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

import dataclasses
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


# Jobs compare by identity (``commit`` looks for the outstanding one) and keep the plain
# repr: a flush job holds up to ``flush_at`` ids.
@dataclasses.dataclass(eq=False, repr=False, slots=True)
class DedupJob:
    """Background work a store planned: ``run()`` in a worker thread, then ``commit``.

    ``run()`` does the work once; called again (``flush_all`` finishing a job the caller
    started) it waits for the first call and returns, or raises its error again.
    """

    kind = "job"

    directory: Path
    _lock: threading.Lock = dataclasses.field(init=False, default_factory=threading.Lock)
    _done: bool = dataclasses.field(init=False, default=False)
    _error: Exception | None = dataclasses.field(init=False, default=None)

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


@dataclasses.dataclass(eq=False, repr=False, slots=True, kw_only=True)
class FlushJob(DedupJob):
    """Write the frozen ids as a run, then set their bits in the live filter.

    The bits are set from the worker thread, with no sort: only bits are set, the filter
    is not resized while a job is outstanding, and until ``commit`` the frozen dict still
    answers for these ids, so a lookup meanwhile is right whichever bits it sees.
    """

    kind = "flush"

    ids: dict[int, int]
    horizon: int
    bloom: BloomFilter
    run_written: MappedRun | None = dataclasses.field(init=False, default=None)

    def _work(self) -> None:
        count = len(self.ids)
        hashes = np.fromiter(self.ids.keys(), dtype=np.uint64, count=count)
        seqs = np.fromiter(self.ids.values(), dtype=np.uint64, count=count)
        live = seqs >= np.uint64(self.horizon)
        hashes, seqs = hashes[live], seqs[live]
        header = write_run(self.directory, hashes, seqs)
        if header is not None:
            self.run_written = MappedRun(self.directory / header.name, header)
            self.bloom.insert(hashes)


@dataclasses.dataclass(eq=False, repr=False, slots=True, kw_only=True)
class MergeJob(DedupJob):
    kind = "merge"

    inputs: tuple[MappedRun, ...]
    horizon: int
    merged: MappedRun | None = dataclasses.field(init=False, default=None)

    def _work(self) -> None:
        header = merge_runs(self.directory, self.inputs, horizon=self.horizon)
        if header is not None:
            self.merged = MappedRun(self.directory / header.name, header)


@dataclasses.dataclass(eq=False, repr=False, slots=True, kw_only=True)
class DeleteJob(DedupJob):
    kind = "delete"

    paths: tuple[Path, ...]

    def _work(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        sync_dir(self.directory)


@dataclasses.dataclass(eq=False, repr=False, slots=True, kw_only=True)
class RebuildFilterJob(DedupJob):
    kind = "rebuild-filter"

    runs: tuple[MappedRun, ...]
    horizon: int
    runs_end: int = dataclasses.field(init=False)
    built: BloomFilter | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.runs_end = max((run.header.end_seq for run in self.runs), default=0)

    def _work(self) -> None:
        self.built = filter_of(self.runs, self.horizon)
        save_filter(self.directory, self.built, self.runs_end)


@dataclasses.dataclass(eq=False, repr=False, slots=True, kw_only=True)
class SaveFilterJob(DedupJob):
    kind = "save-filter"

    bloom: BloomFilter
    runs_end: int

    def _work(self) -> None:
        save_filter(self.directory, self.bloom, self.runs_end)


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
