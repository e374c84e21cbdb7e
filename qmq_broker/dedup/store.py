"""One subject's dedup store: id hash -> seq within the dedup window, in bounded memory.

Layers, newest first: ``recent``, an exact dict of the ids added since the last flush (at
most ``flush_at`` before a flush is planned); the frozen dict of a flush in progress; then
immutable run files (``qmq_broker.dedup.runs``) behind one Bloom filter over all of them
(``qmq_broker.dedup.filter``). ``find`` answers the newest seq it knows for a hash, or None; a
seq below the horizon (the window's start, a seq: stored times increase with seq) is
never answered. A false positive of the filter costs a binary search per run, never a
wrong answer; a hash collision may answer another id's seq, which the caller confirms
against the stored message.

Seqs are added in increasing order (the subject allocates them so). A seq below the end of
what was already flushed, or below the horizon, is ignored: a run already holds it, or it
is expired. Runs therefore cover disjoint seq ranges, except that a crash between a merge
and the deletion of its inputs leaves inputs wholly covered by the merged run, which
opening deletes.

Memory: besides ``recent`` (and one frozen dict while a flush runs), a store keeps a
header per run and the filter. The filter is sized at 16 bits per live id when it is
(re)built, for at least ``MIN_FILTER_IDS`` ids, and rebuilt once the ids it holds pass 1.5
times that (false positives then at most 1.5 %) or once an estimated half of them have
expired or been merged away. The bound: filter bytes <= 2 x max(L, MIN_FILTER_IDS), L the
live ids at its last rebuild. So at most 2 bytes per live id while the window does not
shrink; while it shrinks, at most about 4 bytes per live id once the planned jobs have
run (the expired half is estimated from the runs' seq ranges). Plus 8 KiB, the minimum
filter. A rebuild holds the old and the new filter until it is committed; a merge holds
about ``CHUNK_IDS`` entries of each input at a time.

Start-up: opening reads the run headers and ``filter.bin``, then adds to the filter the
runs written after ``filter.bin`` was saved. That is saved whenever the ids not in it pass
10 % of those in it or ``MAX_UNSAVED_IDS``, and a merge never combines runs from both
sides of what it holds, so a large merged run is never read again on open: what opening
reads is bounded. Run pages that lookups and jobs map in are dropped from the process
(``release_pages``) by the caller after each job and now and then: the runs cost the OS
page cache, not the broker's resident memory.

Threading: every method of ``DedupStore`` runs on the caller's event loop and returns
quickly, except ``open``, ``flush_all``, ``close`` and ``verify``, which block (start-up,
shutdown, tests, offline checks). Blocking work is planned as a job
(``qmq_broker.dedup.jobs``).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from pathlib import Path

import numpy as np

from qmq_broker.dedup.files import check_files, checked_runs, saved_filter
from qmq_broker.dedup.filter import FILTER_FILE, BloomFilter
from qmq_broker.dedup.jobs import (
    DedupJob,
    DeleteJob,
    FlushJob,
    MergeJob,
    RebuildFilterJob,
    SaveFilterJob,
    filter_of,
    merge_inputs,
    save_filter,
)
from qmq_broker.dedup.runs import (
    MappedRun,
)
from qmq_broker.errors import ConfigError, StorageError

VECTOR_MIN = 16  # find_many asks the filter per id below this many ids, with numpy above
MAX_UNSAVED_IDS = 2_000_000  # filter.bin is saved before more ids than this are not in it


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DedupStats:
    recent_ids: int  # in the recent dict and the frozen dict of a flush in progress
    run_ids: int  # entries in the runs, expired ones not yet merged away included
    runs: int
    run_bytes: int
    filter_bytes: int
    filter_ids: int  # ids inserted in the filter since it was last built
    filter_lookups: int
    filter_false_positives: int  # the filter said maybe and no run held the hash


class DedupStore:
    """The dedup table of one subject, in ``<data_dir>/dedup/<subject>/``; see the module."""

    def __init__(
        self,
        directory: Path,
        *,
        flush_at: int,
        fan_in: int,
        horizon: int,
        runs: list[MappedRun],
        bloom: BloomFilter,
        filter_end: int,
        saved_end: int,
        unsaved: int,
        problems: list[str],
    ) -> None:
        """Use ``DedupStore.open``."""
        self.directory = directory
        self.problems = problems
        self._flush_at = flush_at
        self._fan_in = fan_in
        self._horizon = horizon
        self._runs = runs  # by seq range, oldest first; every one is in the filter
        self._filter = bloom
        self._filter_end = filter_end  # runs ending at or below it are in the filter
        self._unsaved = unsaved  # ids inserted in the filter since filter.bin was written
        self._saved_end = saved_end  # filter.bin holds the runs ending at or below it
        estimated_live = sum(run.header.live_estimate(horizon) for run in runs)
        self._stale = max(0, bloom.ids - estimated_live)  # estimated ids in it not live
        self._recent: dict[int, int] = {}
        self._frozen: dict[int, int] | None = None
        self._floor = self.covered_end  # seqs below it are flushed, being flushed or expired
        self._recent_end = self._floor
        self._doomed: list[Path] = []  # files of runs no longer in the store, to delete
        self._outstanding: DedupJob | None = None
        self._lookups = 0
        self._false_positives = 0
        self._closed = False

    # --- opening -------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        flush_at: int = 65_536,
        fan_in: int = 4,
        horizon: int = 0,
    ) -> DedupStore:
        """Open (or create) the store in ``directory``, reading run headers, not bodies.

        Deletes temporary files, runs wholly covered by another (a merge's inputs left by a
        crash) and runs wholly below ``horizon``. A run whose header does not check out is
        deleted and reported in ``problems``, with every run above it: the caller re-adds
        the ids of seqs >= ``covered_end`` from its own index. ``filter.bin`` is used as
        saved, plus the runs written after it (their bodies are read); a missing or damaged
        one is rebuilt from all the runs and reported.
        """
        if flush_at < 1 or fan_in < 2 or horizon < 0:
            raise ConfigError(
                f"dedup store needs flush_at >= 1, fan_in >= 2, horizon >= 0, got "
                f"{flush_at}, {fan_in}, {horizon}"
            )
        path = Path(directory)
        try:
            return cls._open(path, flush_at=flush_at, fan_in=fan_in, horizon=horizon)
        except OSError as exc:
            raise StorageError(f"dedup store {path}: {exc}") from exc

    @classmethod
    def _open(cls, path: Path, *, flush_at: int, fan_in: int, horizon: int) -> DedupStore:
        path.mkdir(parents=True, exist_ok=True)
        problems: list[str] = []
        headers, lost_from = checked_runs(path, problems)
        for header in headers:
            if header.end_seq <= horizon:
                (path / header.name).unlink()
        runs = [MappedRun(path / h.name, h) for h in headers if h.end_seq > horizon]
        runs_end = max((run.header.end_seq for run in runs), default=0)

        bloom, saved_end = saved_filter(path, problems, runs=len(runs))
        if bloom is not None and lost_from is not None and saved_end > lost_from:
            problems.append(f"{path / FILTER_FILE} holds runs that were deleted: rebuilt")
            bloom = None
        unsaved = 0
        if bloom is None:
            bloom = filter_of(runs, horizon)
            saved_end = runs_end
            save_filter(path, bloom, saved_end)
        else:
            for run in runs:
                if run.header.end_seq > saved_end:
                    for hashes in run.live_hashes(horizon):
                        bloom.insert(hashes)
                        unsaved += len(hashes)
        return cls(
            path,
            flush_at=flush_at,
            fan_in=fan_in,
            horizon=horizon,
            runs=runs,
            bloom=bloom,
            filter_end=max(saved_end, runs_end),
            saved_end=saved_end,
            unsaved=unsaved,
            problems=problems,
        )

    # --- the event loop's calls ----------------------------------------------------------

    @property
    def horizon(self) -> int:
        """The window's start: ids of lower seqs are expired."""
        return self._horizon

    @property
    def covered_end(self) -> int:
        """Ids of seqs below it are durable in runs (or expired); the end of the highest run."""
        return max(self._horizon, self._runs[-1].header.end_seq if self._runs else 0)

    def add(self, hashed: int, seq: int) -> None:
        """Remember that id hash ``hashed`` was stored at ``seq``; O(1)."""
        if self._closed:
            raise StorageError(f"dedup store {self.directory} is closed")
        if seq < self._floor:
            return  # a run holds it already, or it is expired
        self._recent[hashed] = seq  # seqs come in increasing order: the newest wins
        if seq >= self._recent_end:
            self._recent_end = seq + 1

    def add_many(self, hashes: list[int], first_seq: int) -> None:
        """``add`` of ``hashes[i]`` at ``first_seq + i``, in one dict update."""
        if self._closed:
            raise StorageError(f"dedup store {self.directory} is closed")
        if first_seq < self._floor:
            for seq, hashed in enumerate(hashes, first_seq):
                self.add(hashed, seq)
            return
        end = first_seq + len(hashes)
        # later pairs win: a hash twice keeps its newest seq
        self._recent.update(zip(hashes, range(first_seq, end), strict=True))
        if end > self._recent_end:
            self._recent_end = end

    def find(self, hashed: int) -> int | None:
        """The newest seq stored under ``hashed`` within the window, None if there is none."""
        if self._closed:
            raise StorageError(f"dedup store {self.directory} is closed")
        seq = self._recent.get(hashed)
        if seq is None and self._frozen is not None:
            seq = self._frozen.get(hashed)
        if seq is None and self._runs:
            self._lookups += 1
            if self._filter.might_contain(hashed):
                seq = self._in_runs(hashed)
        if seq is None or seq < self._horizon:
            return None
        return seq

    def find_many(self, hashes: list[int]) -> list[int | None]:
        """``find`` of each hash; the filter is asked once for the whole list (numpy), and
        the dicts through ``map``, so a produce batch of new ids costs well under a
        microsecond per id."""
        if len(hashes) < VECTOR_MIN:
            return [self.find(hashed) for hashed in hashes]
        if self._closed:
            raise StorageError(f"dedup store {self.directory} is closed")
        found: list[int | None] = list(map(self._recent.get, hashes))
        frozen = self._frozen
        if frozen is not None:
            found = [frozen.get(h) if s is None else s for h, s in zip(hashes, found, strict=True)]
        if self._runs:
            unknown = found.count(None)
            self._lookups += unknown
            if unknown:
                maybe = self._filter.might_contain_many(np.array(hashes, dtype=np.uint64))
                for at in np.flatnonzero(maybe).tolist():
                    if found[at] is None:
                        found[at] = self._in_runs(hashes[at])
        if found.count(None) == len(found):
            return found  # the usual produce: every id new
        horizon = self._horizon
        return [None if seq is None or seq < horizon else seq for seq in found]

    def _in_runs(self, hashed: int) -> int | None:
        """The newest seq a run holds for ``hashed``, after the filter said it may."""
        key = np.uint64(hashed)
        for run in reversed(self._runs):
            seq = run.find(key)
            if seq is not None:
                return seq
        self._false_positives += 1
        return None

    def expire_below(self, seq: int) -> None:
        """Move the window's start to ``seq``: ids of lower seqs are no longer found."""
        old = self._horizon
        if seq <= old:
            return
        self._horizon = seq
        self._floor = max(self._floor, seq)
        self._recent_end = max(self._recent_end, seq)
        self._stale += sum(
            run.header.live_estimate(old) - run.header.live_estimate(seq) for run in self._runs
        )
        expired = []
        for hashed, stored in self._recent.items():  # oldest first
            if stored >= seq:
                break
            expired.append(hashed)
        for hashed in expired:
            del self._recent[hashed]

    def plan(self) -> DedupJob | None:
        """The next piece of background work, None while one is outstanding or all is done.

        In order: a flush (``recent`` reached ``flush_at``, or a failed flush again), a
        merge, deleting files, rebuilding the filter, saving it.
        """
        if self._closed:
            raise StorageError(f"dedup store {self.directory} is closed")
        if self._outstanding is not None:
            return None
        self._drop_expired_runs()
        job = (
            self._plan_flush(force=False)
            or self._plan_merge()
            or self._plan_delete()
            or self._plan_filter()
        )
        self._outstanding = job
        return job

    def commit(self, job: DedupJob) -> bool:
        """Install what ``job`` did; False (and nothing changed) when it did not complete.

        Call it after ``job.run()`` whether that raised or not: until then nothing else is
        planned. A job that failed is planned again by a later ``plan()``.
        """
        if job is not self._outstanding:
            return False
        self._outstanding = None
        if not job.done:
            return False
        if isinstance(job, FlushJob):
            self._install_flush(job)
        elif isinstance(job, MergeJob):
            self._install_merge(job)
        elif isinstance(job, DeleteJob):
            doomed = set(job.paths)
            self._doomed = [path for path in self._doomed if path not in doomed]
        elif isinstance(job, RebuildFilterJob):
            assert job.built is not None
            self._filter = job.built
            self._filter_end = job.runs_end
            self._saved_end = job.runs_end
            self._unsaved = 0
            self._stale = sum(
                run.header.live_estimate(job.horizon) - run.header.live_estimate(self._horizon)
                for run in self._runs
            )
        elif isinstance(job, SaveFilterJob):
            self._unsaved = 0  # nothing changes the filter while a job is outstanding
            self._saved_end = job.runs_end
        return True

    def release_pages(self) -> None:
        """Drop the run pages lookups and jobs mapped in (see ``MappedRun.release_pages``);
        the caller does this now and then, and after each job."""
        for run in self._runs:
            run.release_pages()

    def stats(self) -> DedupStats:
        return DedupStats(
            recent_ids=len(self._recent) + (len(self._frozen) if self._frozen else 0),
            run_ids=sum(run.header.count for run in self._runs),
            runs=len(self._runs),
            run_bytes=sum(run.header.file_size for run in self._runs),
            filter_bytes=self._filter.nbytes,
            filter_ids=self._filter.ids,
            filter_lookups=self._lookups,
            filter_false_positives=self._false_positives,
        )

    # --- blocking calls ------------------------------------------------------------------

    def flush_all(self) -> None:
        """Make every id added so far durable and save the filter (blocking).

        Finishes an outstanding job first (waiting for the worker running it, or running
        it here); its error, if any, went to whoever ran it, and its work is redone here
        when it matters.
        """
        if self._closed:
            raise StorageError(f"dedup store {self.directory} is closed")
        outstanding = self._outstanding
        if outstanding is not None:
            try:
                outstanding.run()
            except Exception:
                pass  # its runner had the error; a failed flush is redone below
            finally:
                self.commit(outstanding)
        self._drop_expired_runs()
        while (job := self._plan_flush(force=True)) is not None:
            self._run_here(job)
        deleting = self._plan_delete()
        if deleting is not None:
            self._run_here(deleting)
        if self._unsaved:
            self._run_here(
                SaveFilterJob(self.directory, bloom=self._filter, runs_end=self._filter_end)
            )

    def close(self) -> None:
        """``flush_all``, then release the runs (blocking); the store is unusable after."""
        if self._closed:
            return
        try:
            self.flush_all()
        finally:
            self._closed = True
            self._runs = []
            self._recent = {}
            self._frozen = None

    def verify(self) -> list[str]:
        """Check every run's body and that the filter holds its ids (blocking, offline)."""
        return check_files(self.directory, self._runs, self._filter, horizon=self._horizon)

    # --- planning and installing ---------------------------------------------------------

    def _run_here(self, job: DedupJob) -> None:
        self._outstanding = job
        try:
            job.run()
        finally:
            self.commit(job)

    def _drop_expired_runs(self) -> None:
        """Runs wholly below the horizon leave the store; their files go to the next delete."""
        if self._outstanding is not None:
            return  # a job may be reading them
        expired = 0
        while expired < len(self._runs) and self._runs[expired].header.end_seq <= self._horizon:
            expired += 1
        if expired:
            self._doomed.extend(run.path for run in self._runs[:expired])
            del self._runs[:expired]

    def _plan_flush(self, *, force: bool) -> DedupJob | None:
        if self._frozen is None:
            if not self._recent or (len(self._recent) < self._flush_at and not force):
                return None
            self._frozen, self._recent = self._recent, {}
            self._floor = max(self._floor, self._recent_end)
        return FlushJob(self.directory, ids=self._frozen, horizon=self._horizon, bloom=self._filter)

    def _plan_merge(self) -> DedupJob | None:
        inputs = merge_inputs(
            self._runs, flush_at=self._flush_at, fan_in=self._fan_in, saved_end=self._saved_end
        )
        if inputs is None:
            return None
        return MergeJob(self.directory, inputs=inputs, horizon=self._horizon)

    def _plan_delete(self) -> DedupJob | None:
        if not self._doomed:
            return None
        return DeleteJob(self.directory, paths=tuple(self._doomed))

    def _plan_filter(self) -> DedupJob | None:
        bloom = self._filter
        if bloom.ids > bloom.capacity or 2 * self._stale > bloom.ids > 0:
            return RebuildFilterJob(self.directory, runs=tuple(self._runs), horizon=self._horizon)
        if 10 * self._unsaved > bloom.ids or self._unsaved > MAX_UNSAVED_IDS:
            return SaveFilterJob(self.directory, bloom=bloom, runs_end=self._filter_end)
        return None

    def _install_flush(self, job: FlushJob) -> None:
        run = job.run_written
        if run is not None:
            bisect.insort(self._runs, run, key=lambda mapped: mapped.header.first_seq)
            self._unsaved += run.header.count
            self._filter_end = max(self._filter_end, run.header.end_seq)
        self._frozen = None

    def _install_merge(self, job: MergeJob) -> None:
        start = next(at for at, run in enumerate(self._runs) if run is job.inputs[0])
        stop = start + len(job.inputs)
        assert all(a is b for a, b in zip(self._runs[start:stop], job.inputs, strict=True))
        merged = [] if job.merged is None else [job.merged]
        self._runs[start:stop] = merged
        self._doomed.extend(run.path for run in job.inputs)
        # entries the estimates took for live but the merge found expired
        horizon = self._horizon
        before = sum(run.header.live_estimate(horizon) for run in job.inputs)
        after = sum(run.header.live_estimate(horizon) for run in merged)
        self._stale = max(0, self._stale + before - after)
