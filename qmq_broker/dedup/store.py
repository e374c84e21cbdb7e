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
shutdown, tests, offline checks). Blocking work is planned as a ``DedupJob``::

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

import bisect
import dataclasses
import itertools
import os
import threading
from pathlib import Path

import numpy as np

from qmq_broker.dedup.filter import FILTER_FILE, BloomFilter
from qmq_broker.dedup.runs import (
    TEMP_SUFFIX,
    MappedRun,
    RunHeader,
    merge_runs,
    parse_run_name,
    read_run_header,
    verify_run,
    write_run,
)
from qmq_broker.errors import ConfigError, CorruptRecord, StorageError
from qmq_broker.storage.fsync import rewrite_file, sync_dir

VECTOR_MIN = 16  # find_many asks the filter per id below this many ids, with numpy above
MAX_UNSAVED_IDS = 2_000_000  # filter.bin is saved before more ids than this are not in it
SIZE_CLASS_BASE = 4  # a run's size class: floor(log4(count / flush_at)), 0 below 4 x flush_at


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


class _Flush(DedupJob):
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


class _Merge(DedupJob):
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


class _Delete(DedupJob):
    kind = "delete"

    def __init__(self, directory: Path, *, paths: tuple[Path, ...]) -> None:
        super().__init__(directory)
        self.paths = paths

    def _work(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        sync_dir(self.directory)


class _RebuildFilter(DedupJob):
    kind = "rebuild-filter"

    def __init__(self, directory: Path, *, runs: tuple[MappedRun, ...], horizon: int) -> None:
        super().__init__(directory)
        self.runs = runs
        self.horizon = horizon
        self.runs_end = max((run.header.end_seq for run in runs), default=0)
        self.built: BloomFilter | None = None

    def _work(self) -> None:
        self.built = _filter_of(self.runs, self.horizon)
        _save_filter(self.directory, self.built, self.runs_end)


class _SaveFilter(DedupJob):
    kind = "save-filter"

    def __init__(self, directory: Path, *, bloom: BloomFilter, runs_end: int) -> None:
        super().__init__(directory)
        self._bloom = bloom
        self.runs_end = runs_end

    def _work(self) -> None:
        _save_filter(self.directory, self._bloom, self.runs_end)


def _filter_of(runs: tuple[MappedRun, ...] | list[MappedRun], horizon: int) -> BloomFilter:
    """A filter sized for, and holding, the live ids of ``runs``."""
    bloom = BloomFilter.sized(sum(run.live_count(horizon) for run in runs))
    for run in runs:
        for hashes in run.live_hashes(horizon):
            bloom.insert(hashes)
    return bloom


def _save_filter(directory: Path, bloom: BloomFilter, runs_end: int) -> None:
    path = directory / FILTER_FILE
    temp = path.with_name(path.name + TEMP_SUFFIX)
    header, bits = bloom.encode(runs_end=runs_end)
    rewrite_file(temp, header, bits)
    os.replace(temp, path)
    sync_dir(directory)


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
        headers, lost_from = _checked_runs(path, problems)
        for header in headers:
            if header.end_seq <= horizon:
                (path / header.name).unlink()
        runs = [MappedRun(path / h.name, h) for h in headers if h.end_seq > horizon]
        runs_end = max((run.header.end_seq for run in runs), default=0)

        bloom, saved_end = _saved_filter(path, problems, runs=len(runs))
        if bloom is not None and lost_from is not None and saved_end > lost_from:
            problems.append(f"{path / FILTER_FILE} holds runs that were deleted: rebuilt")
            bloom = None
        unsaved = 0
        if bloom is None:
            bloom = _filter_of(runs, horizon)
            saved_end = runs_end
            _save_filter(path, bloom, saved_end)
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
        if isinstance(job, _Flush):
            self._install_flush(job)
        elif isinstance(job, _Merge):
            self._install_merge(job)
        elif isinstance(job, _Delete):
            doomed = set(job.paths)
            self._doomed = [path for path in self._doomed if path not in doomed]
        elif isinstance(job, _RebuildFilter):
            assert job.built is not None
            self._filter = job.built
            self._filter_end = job.runs_end
            self._saved_end = job.runs_end
            self._unsaved = 0
            self._stale = sum(
                run.header.live_estimate(job.horizon) - run.header.live_estimate(self._horizon)
                for run in self._runs
            )
        elif isinstance(job, _SaveFilter):
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
                _SaveFilter(self.directory, bloom=self._filter, runs_end=self._filter_end)
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
        problems: list[str] = []
        for run in self._runs:
            problems.extend(verify_run(run))
            missing = sum(
                self._filter.contains_all(hashes) for hashes in run.live_hashes(self._horizon)
            )
            if missing:
                problems.append(f"{run.path}: {missing} ids missing from the filter")
        path = self.directory / FILTER_FILE
        try:
            BloomFilter.decode(path.read_bytes(), path=str(path))
        except CorruptRecord as exc:
            problems.append(str(exc))
        except FileNotFoundError:
            problems.append(f"{path} missing")
        return problems

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
        return _Flush(self.directory, ids=self._frozen, horizon=self._horizon, bloom=self._filter)

    def _plan_merge(self) -> DedupJob | None:
        classes = [self._size_class(run.header.count) for run in self._runs]
        saved = self._saved_end
        for size_class, side in itertools.product(sorted(set(classes)), (True, False)):
            # A merge takes runs from one side of what filter.bin holds, never both: on
            # open, the runs past it are read again, and only those (see MAX_UNSAVED_IDS).
            members = [
                at
                for at, found in enumerate(classes)
                if found == size_class and (self._runs[at].header.end_seq <= saved) == side
            ]
            if len(members) >= self._fan_in:
                # the newest fan_in of the class, and any run between them, so that the
                # merged run's range covers only its own inputs
                start, stop = members[-self._fan_in], members[-1] + 1
                inputs = tuple(self._runs[start:stop])
                return _Merge(self.directory, inputs=inputs, horizon=self._horizon)
        return None

    def _plan_delete(self) -> DedupJob | None:
        if not self._doomed:
            return None
        return _Delete(self.directory, paths=tuple(self._doomed))

    def _plan_filter(self) -> DedupJob | None:
        bloom = self._filter
        if bloom.ids > bloom.capacity or 2 * self._stale > bloom.ids > 0:
            return _RebuildFilter(self.directory, runs=tuple(self._runs), horizon=self._horizon)
        if 10 * self._unsaved > bloom.ids or self._unsaved > MAX_UNSAVED_IDS:
            return _SaveFilter(self.directory, bloom=bloom, runs_end=self._filter_end)
        return None

    def _size_class(self, count: int) -> int:
        size_class = 0
        limit = self._flush_at * SIZE_CLASS_BASE
        while count >= limit:
            size_class += 1
            limit *= SIZE_CLASS_BASE
        return size_class

    def _install_flush(self, job: _Flush) -> None:
        run = job.run_written
        if run is not None:
            bisect.insort(self._runs, run, key=lambda mapped: mapped.header.first_seq)
            self._unsaved += run.header.count
            self._filter_end = max(self._filter_end, run.header.end_seq)
        self._frozen = None

    def _install_merge(self, job: _Merge) -> None:
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


def _checked_runs(path: Path, problems: list[str]) -> tuple[list[RunHeader], int | None]:
    """The run headers that check out, by seq range; and the seq from which runs were lost.

    Deletes temporary files, runs wholly covered by another, runs whose header is damaged
    and every run above a damaged one (the caller re-adds those ids).
    """
    headers: list[RunHeader] = []
    damaged: list[tuple[int, int]] = []
    for entry in sorted(path.iterdir()):
        if entry.name.endswith(TEMP_SUFFIX):
            entry.unlink()
            continue
        if entry.name == FILTER_FILE:
            continue
        seqs = parse_run_name(entry.name)
        if seqs is None:
            problems.append(f"{entry}: not a dedup file, left alone")
            continue
        try:
            headers.append(read_run_header(entry))
        except CorruptRecord as exc:
            problems.append(f"{exc}: deleted")
            entry.unlink()
            damaged.append(seqs)
    # widest first, so a merged run is kept before the inputs it covers
    headers.sort(key=lambda h: (h.first_seq, -h.end_seq))
    kept: list[RunHeader] = []
    for header in headers:
        if kept and kept[-1].covers(header):
            (path / header.name).unlink()
        else:
            kept.append(header)
    lost = [
        first
        for first, end in damaged
        if not any(h.first_seq <= first and end <= h.end_seq for h in kept)
    ]
    lost += [b.first_seq for a, b in itertools.pairwise(kept) if b.first_seq < a.end_seq]
    if not lost:
        return kept, None
    lost_from = min(lost)
    above = [h for h in kept if h.first_seq >= lost_from]
    for header in above:
        (path / header.name).unlink()
    problems.append(
        f"{path}: ids of seqs from {lost_from} lost with damaged runs, {len(above)} runs "
        "above them deleted; they are re-added from the subject's index"
    )
    return [h for h in kept if h.first_seq < lost_from], lost_from


def _saved_filter(path: Path, problems: list[str], *, runs: int) -> tuple[BloomFilter | None, int]:
    """``filter.bin`` and its runs_end; None when missing or damaged (reported if runs)."""
    filter_path = path / FILTER_FILE
    try:
        data = filter_path.read_bytes()
    except FileNotFoundError:
        if runs:
            problems.append(f"{filter_path} missing: rebuilt from {runs} runs")
        return None, 0
    try:
        return BloomFilter.decode(data, path=str(filter_path))
    except CorruptRecord as exc:
        problems.append(f"{exc}: rebuilt from the runs")
        return None, 0
