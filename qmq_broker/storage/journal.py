"""The journal: group commit of the message log, the action log, the subject indexes and
the bucketed schedule and dispatch logs.

Appends are placed on the event loop and collected into the current batch. At the end of
the loop's turn the batch goes to the journal's writer thread, which writes it and, under
``fsync always``, fdatasyncs every log segment it wrote, then hands the batch back to the
loop in one call, where each caller's future resolves (one per caller: a caller cancelled
cancels only its own; under ``interval:<ms>`` a timer asks the writer for the fsync; under
``never`` only checkpoints and shutdown do). While one batch is being written the next one
fills up, and goes as soon as the first is back, so concurrent producers share one write +
fsync. A small batch (``INLINE_BYTES``) found with the writer idle is written by the loop
itself, as Redis does under ``appendfsync always``: the hand-off would cost more than the
write, and what arrives during the fsync waits in the socket buffers and goes with the next
batch. Only while fsyncs are quick, though (``INLINE_FSYNC_S``): on a slow disk the loop
would stall, so every batch goes to the thread. And not a batch of actions to fsync
(leases, acks, nacks): see ``_inline``.

Leases, acks and nacks are "relaxed" actions: under ``--ack-fsync interval:<ms>`` or
``never`` a batch of nothing else is written but not fsynced; they reach the disk with the
next fsync. Index files are written with each batch but fsynced only by checkpoints:
recovery rebuilds index entries past the checkpoint from the log.

Every live append of the broker goes through here. The fsync calls themselves, and the
few writes outside the journal (checkpoints, recovery's repairs), are in
``qmq_broker.storage.fsync``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from qmq_broker.config import FsyncPolicy
from qmq_broker.errors import StorageError
from qmq_broker.format.files import HEADER_SIZE, KIND_DIRS, SegmentKind, segment_header
from qmq_broker.format.frames import frame
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY,
    INDEX_HEADER,
    chunk_start,
    entry_offset,
    index_chunk_path,
    index_header,
)
from qmq_broker.format.schedule import BucketTally
from qmq_broker.storage.buckets import BucketFiles, BucketKey, BucketPlacer
from qmq_broker.storage.fsync import sync_all, sync_data, sync_dir, sync_new_file
from qmq_broker.storage.index_files import CHUNK_BYTES
from qmq_broker.storage.segments import LogPlacer, Position, segment_path

logger = logging.getLogger(__name__)

FsyncObserver = Callable[[float], None]


@dataclasses.dataclass(slots=True)
class _Batch:
    # runs of frames placed one after the other: (segment, offset of the first, frames)
    messages: list[tuple[int, int, list[bytes]]] = dataclasses.field(default_factory=list)
    actions: list[tuple[int, int, list[bytes]]] = dataclasses.field(default_factory=list)
    index: dict[str, tuple[int, list[bytes]]] = dataclasses.field(default_factory=dict)
    buckets: list[tuple[SegmentKind, Position, bytes]] = dataclasses.field(default_factory=list)
    tallies: dict[BucketKey, BucketTally] = dataclasses.field(default_factory=dict)
    jobs: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    # one future per caller: a caller's task cancelled cancels its own, not the others'
    waiters: list[asyncio.Future[None]] = dataclasses.field(default_factory=list)
    needs_fsync: bool = False  # under --fsync always: holds more than relaxed actions
    size: int = 0  # bytes of frames placed

    def empty(self) -> bool:
        return not (self.messages or self.actions or self.buckets or self.jobs)


ROOM_BYTES = 4 << 20  # how far a log segment's file is allocated ahead of its appends
# A batch this small is written on the event loop itself when the writer thread is idle: the
# hand-off to the thread and back costs more CPU and latency than writing a few KiB. Under
# --fsync always the loop then waits for the fsync too, so only while fsyncs are quick
# (their moving average under INLINE_FSYNC_S): a slow disk's fsyncs stay on the thread, and
# the loop goes on serving meanwhile.
INLINE_BYTES = 64 << 10
INLINE_FSYNC_S = 0.001


@dataclasses.dataclass(slots=True)
class _OpenLog:
    segment: int
    fd: int
    end: int  # the segment's data ends here
    allocated: int  # the file's size: zero room from ``end`` up to here


class _AppendFiles:
    """Open append descriptors per log and per index, used by whoever writes a batch: the
    writer thread, or the loop for a small batch while the thread is idle (never both).

    A log segment's file is allocated ``ROOM_BYTES`` ahead of its appends (``fallocate``;
    format 4's room, ``qmq_broker.format``): an fdatasync after an append that grew the file
    must also commit the new size, which makes it markedly slower.
    Rolling to the next segment and closing cut the room off.
    """

    def __init__(
        self, data_dir: Path, *, segment_bytes: int, ends: dict[SegmentKind, tuple[int, int]]
    ) -> None:
        self._data_dir = data_dir
        self._segment_bytes = segment_bytes
        self._found_ends = dict(ends)  # where each log's data ended when the journal began
        self._logs: dict[SegmentKind, _OpenLog] = {}
        self._index: dict[str, tuple[int, int]] = {}  # subject -> (chunk start, fd)
        self._room = True  # False once the file system refused to allocate ahead
        self.dirty: set[int] = set()
        self.buckets = BucketFiles(data_dir)

    def write_log(self, kind: SegmentKind, segment: int, offset: int, data: bytes) -> None:
        """Write frames at ``offset`` of a log segment, making room ahead when it runs out."""
        log = self._log(kind, segment)
        end = offset + len(data)
        if end > log.allocated and self._room:
            self._make_room(log, end)
        if os.pwrite(log.fd, data, offset) != len(data):
            raise StorageError(f"short write to {kind.name} segment {segment}")
        log.end = max(log.end, end)
        self.dirty.add(log.fd)

    def _make_room(self, log: _OpenLog, end: int) -> None:
        allocate_to = max(end, min(end + ROOM_BYTES, self._segment_bytes))
        try:
            os.posix_fallocate(log.fd, log.allocated, allocate_to - log.allocated)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise  # ENOSPC and the like: the write would fail as well
            self._room = False  # this file system cannot: the files grow with each write
            return
        log.allocated = allocate_to

    def _log(self, kind: SegmentKind, segment: int) -> _OpenLog:
        current = self._logs.get(kind)
        if current is not None and current.segment == segment:
            return current
        if current is not None:
            del self._logs[kind]
            self._close_log(current)
        path = segment_path(self._data_dir, kind, segment)
        existed = path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        size = os.fstat(fd).st_size
        if not existed or size == 0:
            os.pwrite(fd, segment_header(kind), 0)
            sync_new_file(fd, path)
            size = HEADER_SIZE
        found = self._found_ends.pop(kind, None)  # its segment is the first this log opens
        if found is not None and found[0] != segment:  # rolled at once: cut the old one's room
            earlier = self._reopen(kind, *found)
            if earlier is not None:
                self._close_log(earlier)
            found = None
        end = found[1] if found is not None else HEADER_SIZE
        log = self._logs[kind] = _OpenLog(segment=segment, fd=fd, end=end, allocated=size)
        return log

    def _close_log(self, log: _OpenLog) -> None:
        """Cut the room off a log segment, make it durable, close it."""
        if log.allocated > log.end:
            os.ftruncate(log.fd, log.end)
        sync_all(log.fd)
        os.close(log.fd)
        self.dirty.discard(log.fd)

    def write_index(self, subject: str, first_seq: int, entries: list[bytes]) -> None:
        """Write a subject's entries from ``first_seq`` into its chunk files, sealing each
        chunk the entries fill."""
        seq = first_seq
        at = 0
        while at < len(entries):
            start = chunk_start(seq)
            take = min(len(entries) - at, start + INDEX_CHUNK_ENTRIES - seq)
            fd = self._index_fd(subject, start)
            data = b"".join(entries[at : at + take])
            if os.pwrite(fd, data, entry_offset(seq)) != len(data):
                raise StorageError(f"short write to the index of {subject}")
            seq += take
            at += take
            if seq - start == INDEX_CHUNK_ENTRIES:
                self._seal(subject, start, fd)

    def _index_fd(self, subject: str, start: int) -> int:
        current = self._index.get(subject)
        if current is not None and current[0] == start:
            return current[1]
        if current is not None:  # a chunk left unsealed (cannot happen: seals on filling)
            sync_all(current[1])
            os.close(current[1])
        path = index_chunk_path(self._data_dir, subject, start)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True)
            sync_dir(path.parent.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size == 0:
            os.pwrite(fd, index_header(), 0)
            sync_new_file(fd, path)
        self._index[subject] = (start, fd)
        return fd

    def _seal(self, subject: str, start: int, fd: int) -> None:
        """A full chunk gets its CRC in its header and is forced to disk, once for all."""
        entries = os.pread(fd, CHUNK_BYTES, INDEX_HEADER.size)
        os.pwrite(fd, index_header(zlib.crc32(entries)), 0)
        sync_all(fd)
        os.close(fd)
        del self._index[subject]

    def _reopen(self, kind: SegmentKind, segment: int, end: int) -> _OpenLog | None:
        path = segment_path(self._data_dir, kind, segment)
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:  # gone, or its directory is: nothing to cut
            return None
        return _OpenLog(segment=segment, fd=fd, end=end, allocated=os.fstat(fd).st_size)

    def fsync_logs(self) -> None:
        for fd in list(self.dirty):
            sync_data(fd)
        self.dirty.clear()
        self.buckets.fsync()

    def fsync_indexes(self) -> None:
        for _, fd in self._index.values():
            sync_data(fd)
        self.buckets.fsync_tallies()

    def close(self) -> None:
        for kind in (SegmentKind.MESSAGES, SegmentKind.ACTIONS):
            log = self._logs.get(kind)
            if log is None:  # not written since the start: cut what room it may have left
                found = self._found_ends.pop(kind, None)
                if found is None:
                    continue
                log = self._reopen(kind, *found)
                if log is None:
                    continue
            self._close_log(log)
        for _, fd in self._index.values():
            sync_all(fd)
            os.close(fd)
        self._logs.clear()
        self._index.clear()
        self.buckets.close()


class Journal:
    """Group-committed appends to the message log, the action log and subject indexes."""

    def __init__(
        self,
        *,
        data_dir: Path,
        fsync: FsyncPolicy,
        segment_bytes: int,
        messages_at: tuple[int, int],
        actions_at: tuple[int, int],
        buckets_at: dict[BucketKey, int] | None = None,
        bucket_records: dict[BucketKey, int] | None = None,
        on_fsync: FsyncObserver | None = None,
        ack_fsync: FsyncPolicy | None = None,
    ) -> None:
        self._data_dir = data_dir
        self._fsync = fsync
        ack_fsync = ack_fsync or fsync
        # Relaxed actions (leases, acks, nacks) do not make a batch wait for an fsync when
        # the policy for them is weaker than --fsync always: they reach the disk with the
        # next fsync, the ack timer's (interval) or a produce's or checkpoint's (never).
        self._relaxed = fsync.mode == "always" and ack_fsync.mode != "always"
        self._ack_fsync = ack_fsync
        self.messages = LogPlacer(
            segment_bytes=segment_bytes, segment=messages_at[0], end_offset=messages_at[1]
        )
        self.actions = LogPlacer(
            segment_bytes=segment_bytes, segment=actions_at[0], end_offset=actions_at[1]
        )
        self.buckets = BucketPlacer(buckets_at, bucket_records)
        self._files = _AppendFiles(
            data_dir,
            segment_bytes=segment_bytes,
            ends={SegmentKind.MESSAGES: messages_at, SegmentKind.ACTIONS: actions_at},
        )
        # the writer thread's inbox: a batch to write, or None to close the files and stop
        self._inbox: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._writer_loop, name="qmq-journal-writer", daemon=True
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch = _Batch()
        self._writing = False  # a batch is being written (by the writer thread or the loop)
        # moving average of the log fsyncs' durations: small batches are written on the
        # loop only while it is under INLINE_FSYNC_S
        self.fsync_average_s = 0.0
        self._dispatching = False  # _dispatch is due at the end of this loop turn
        self._stopped: asyncio.Future[None] | None = None
        self._closing = False
        self._failed: BaseException | None = None
        self._on_fsync = on_fsync
        self._tasks: list[asyncio.Task[None]] = []
        for kind in (SegmentKind.MESSAGES, SegmentKind.ACTIONS):
            (data_dir / KIND_DIRS[kind]).mkdir(parents=True, exist_ok=True)
        (data_dir / "index").mkdir(parents=True, exist_ok=True)

    # --- event-loop side -----------------------------------------------------------------

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._writer.start()
        interval = None
        if self._fsync.mode == "interval":
            interval = self._fsync.interval_ms
        elif self._relaxed and self._ack_fsync.mode == "interval":
            interval = self._ack_fsync.interval_ms
        if interval is not None:
            self._tasks.append(
                asyncio.create_task(self._interval_fsync_loop(interval), name="qmq-journal-fsync")
            )

    def _future(self) -> asyncio.Future[None]:
        if self._failed is not None:
            raise StorageError("the journal failed earlier; the broker is read-only") from (
                self._failed
            )
        if self._closing:
            raise StorageError("the journal is closed")
        loop = self._loop
        assert loop is not None, "start() the journal first"
        future = loop.create_future()
        self._batch.waiters.append(future)
        if not (self._writing or self._dispatching):
            # at the end of this turn, so that what else this turn appends joins the batch
            self._dispatching = True
            loop.call_soon(self._dispatch)
        return future

    def append_messages(
        self, frames: list[bytes], *, subject: str, first_seq: int, stored_at_us: int,
        hashed_ids: list[int],
    ) -> list[bytes]:  # fmt: skip
        """Place the message frames (``message_frames``) of a subject's seqs from
        ``first_seq`` on, and their index entries; returns the packed entries (a subject's
        seqs come in order, one after the other).

        Durable once ``commit_point()`` resolves.
        """
        placer = self.messages
        pack = INDEX_ENTRY.pack
        placed = self._batch.messages
        entries = []
        lengths = list(map(len, frames))
        size = sum(lengths)
        run = placer.place_run(size)
        if run is not None:  # the usual request: its frames in one run of the segment
            segment, offset = run
            placed.append((segment, offset, frames))
            for length, hashed in zip(lengths, hashed_ids, strict=True):
                entries.append(pack(segment, length, offset, stored_at_us, hashed))
                offset += length
        else:  # the segment rolls within the request
            for framed, hashed in zip(frames, hashed_ids, strict=True):
                position = placer.place(len(framed))
                placed.append((position.segment, position.offset, [framed]))
                entries.append(
                    pack(position.segment, position.length, position.offset, stored_at_us, hashed)
                )
        batch = self._batch
        batch.needs_fsync = True
        batch.size += size
        pending = batch.index.get(subject)
        if pending is None:
            batch.index[subject] = (first_seq, list(entries))
        else:
            pending[1].extend(entries)
        return entries

    def append_action(self, payload: bytes, *, relaxed: bool = False) -> Position:
        """Place an action record; ``relaxed`` (a lease, ack or nack) follows --ack-fsync."""
        framed = frame(payload)
        position = self.actions.place(len(framed))
        batch = self._batch
        batch.actions.append((position.segment, position.offset, [framed]))
        batch.size += len(framed)
        if not (relaxed and self._relaxed):
            batch.needs_fsync = True
        return position

    def append_bucket(self, kind: SegmentKind, bucket: int, payload: bytes) -> Position:
        """Place one frame in a bucketed log (schedule, dispatch); durable with the batch."""
        framed = frame(payload)
        position = self.buckets.place(kind, bucket, len(framed))
        batch = self._batch
        batch.buckets.append((kind, position, framed))
        tally = self.buckets.tally(kind, bucket)
        if tally is not None:
            batch.tallies[(kind, bucket)] = tally
        batch.needs_fsync = True
        batch.size += len(framed)
        return position

    def remove_buckets(self, keys: list[BucketKey]) -> asyncio.Future[None]:
        """Delete bucket segments once everything appended so far is written."""
        for kind, bucket in keys:
            self.buckets.forget(kind, bucket)

        def job() -> None:
            for kind, bucket in keys:
                self._files.buckets.remove(kind, bucket)

        return self.run_after_flush(job)

    def commit_point(self) -> asyncio.Future[None]:
        """A future that resolves once everything appended so far is durable (per policy)."""
        return self._future()

    def run_after_flush(self, job: Callable[[], None]) -> asyncio.Future[None]:
        """Run ``job`` on the writer thread after everything appended so far is written."""
        self._batch.jobs.append(job)
        return self._future()

    def fsync_indexes(self) -> None:
        """Writer-thread only (call from a ``run_after_flush`` job)."""
        self._files.fsync_indexes()

    def fsync_logs(self) -> None:
        """Writer-thread only (call from a ``run_after_flush`` job)."""
        self._files.fsync_logs()

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def _dispatch(self) -> None:
        """Write the current batch: a small one here and now, others on the writer thread
        (an empty one resolves at once)."""
        self._dispatching = False
        if self._writing or self._failed is not None:
            return  # _written dispatches what gathered meanwhile
        batch = self._batch
        if batch.empty():
            waiters, batch.waiters = batch.waiters, []
            _resolve(waiters, None)
            return
        self._batch = _Batch()
        self._writing = True
        if not self._inline(batch):
            self._inbox.put(batch)
            return
        error: Exception | None = None
        try:
            self._write(batch)
        except Exception as exc:  # as on the thread: the journal turns read-only
            error = exc
        self._written(batch, error)

    def _inline(self, batch: _Batch) -> bool:
        """Whether the loop writes ``batch`` itself (module docstring): small, no jobs, quick
        fsyncs, and no action to fsync. The pulls that append leases and acks are
        scheduled fairly by group, and a loop blocked in their fsync is time no group is
        charged for, which would skew the shares between groups."""
        return not (
            batch.jobs
            or batch.size > INLINE_BYTES
            or self.fsync_average_s > INLINE_FSYNC_S
            or (batch.actions and batch.needs_fsync)
        )

    def _written(self, batch: _Batch, error: BaseException | None) -> None:
        """Back from the writer thread, on the loop: resolve the batch, send the next."""
        self._writing = False
        if error is None:
            _resolve(batch.waiters, None)
            if self._batch.waiters:
                self._dispatch()
            return
        # a failed write leaves the log in doubt: stop taking writes
        self._failed = error
        logger.critical(
            "journal write failed; broker is now read-only",
            extra={"action": "broker.journal_failed"},
            exc_info=error,
        )
        _resolve([*batch.waiters, *self._batch.waiters], error)

    async def _interval_fsync_loop(self, interval_ms: int) -> None:
        while not self._closing:
            await asyncio.sleep(interval_ms / 1000)
            with contextlib.suppress(StorageError):
                await self.run_after_flush(self._fsync_if_written)

    # --- writer-thread side ---------------------------------------------------------------

    def _writer_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        assert self._stopped is not None
        while (batch := self._inbox.get()) is not None:
            error: BaseException | None = None
            try:
                self._write(batch)
            except BaseException as exc:  # reported on the loop: the journal turns read-only
                error = exc
            try:
                loop.call_soon_threadsafe(self._written, batch, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
        closed: BaseException | None = None
        try:
            self._files.close()
        except BaseException as exc:
            closed = exc
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle_future, self._stopped, closed)

    def _write(self, batch: _Batch) -> None:
        self._write_log(SegmentKind.MESSAGES, batch.messages)
        self._write_log(SegmentKind.ACTIONS, batch.actions)
        self._write_buckets(batch.buckets)
        for subject, (first_seq, entries) in batch.index.items():
            self._files.write_index(subject, first_seq, entries)
        if self._fsync.mode == "always" and batch.needs_fsync:
            self._timed_fsync()
        for tally in batch.tallies.values():  # never ahead of its segment
            self._files.buckets.write_tally(tally)
        for job in batch.jobs:
            job()

    def _write_log(self, kind: SegmentKind, runs: list[tuple[int, int, list[bytes]]]) -> None:
        """Write runs of frames, those of one segment (one after the other) in one write."""
        start = 0
        while start < len(runs):
            segment, offset, _ = runs[start]
            end = start + 1
            while end < len(runs) and runs[end][0] == segment:
                end += 1
            data = b"".join(itertools.chain.from_iterable(run[2] for run in runs[start:end]))
            self._files.write_log(kind, segment, offset, data)
            start = end

    def _write_buckets(self, frames: list[tuple[SegmentKind, Position, bytes]]) -> None:
        grouped: dict[BucketKey, list[tuple[Position, bytes]]] = {}
        for kind, position, framed in frames:
            grouped.setdefault((kind, position.segment), []).append((position, framed))
        files = self._files.buckets
        for (kind, bucket), items in grouped.items():
            fd = files.fd(kind, bucket)
            data = b"".join(f for _, f in items)
            if os.pwrite(fd, data, items[0][0].offset) != len(data):
                raise StorageError(f"short write to {kind.name} segment {bucket}")
            files.dirty.add(fd)

    def _fsync_if_written(self) -> None:
        if self._files.dirty or self._files.buckets.dirty:
            self._timed_fsync()

    def _timed_fsync(self) -> None:
        began = time.perf_counter()
        self._files.fsync_logs()
        took = time.perf_counter() - began
        # one thread at a time writes it (see _dispatch); a float store is atomic anyway
        self.fsync_average_s += (took - self.fsync_average_s) * 0.125
        if self._on_fsync is not None:
            self._on_fsync(took)

    # --- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        """Write and fsync everything pending, then close the files and stop the writer."""
        if self._failed is None:
            with contextlib.suppress(StorageError):
                await self.run_after_flush(self._files.fsync_logs)
        self._closing = True
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._stopped is None:  # never started
            self._files.close()
            return
        self._inbox.put(None)  # after any batch still with the writer (a failed journal's)
        await self._stopped
        self._writer.join()  # it has nothing left to do but return


def _resolve(waiters: list[asyncio.Future[None]], error: BaseException | None) -> None:
    """Resolve a batch's waiters: written, or ``StorageError`` for a failed write (a waiter
    whose task was cancelled is done already)."""
    for waiter in waiters:
        if waiter.done():
            continue
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(StorageError(f"write failed: {error!r}"))


def _settle_future(future: asyncio.Future[None], error: BaseException | None) -> None:
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
