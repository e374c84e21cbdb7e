"""The read side of a pull: read, check, decode and shape the records a decision leased.

What is in the page cache is read on the event loop (``read_cached``). What is not is
first asked of the kernel in the background (``read_ahead``) and read on the loop once it
has arrived; only what does not arrive in time is read on the broker's read pool
(``read_batches``), where a slow read blocks only its own thread. Inputs are immutable
(positions resolved on the loop) and ``SegmentReader`` is thread-safe. A run of adjacent
frames (a batch of a subject's consecutive messages usually sits back to back in one
segment) is read with one ``pread``: one system call and one GIL hand-off per run instead
of one per message.

``delay_s`` (``--debug-read-delay-ms``) sleeps before each batch read of a group on a read
thread: it stands in for a cold disk in benchmarks and tests (``PullService`` waits it on
the loop instead when it reads ahead).
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections.abc import Iterator

from qmq_broker.errors import CorruptRecord, StorageError
from qmq_broker.format.frames import FRAME_SIZE, crc32, read_frame_at
from qmq_broker.format.messages import FRAMED_PEEK, MessageRecord, message_fields, peek_message
from qmq_broker.messages import pulled_fields
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectLog
from qmq_wire import PulledMessageJson
from qmq_wire.records import RECORD_MESSAGE, SUBJECT_AT, records_entry

MAX_RUN_BYTES = 4 * 1024 * 1024  # read by one pread at most

# A served message: its JSON, or its record as stored behind its attempt and partition.
Served = PulledMessageJson | bytes
Read = tuple[list[Served], list[tuple[int, str]]]  # messages, (seq, error)


def read_message(reader: SegmentReader, log: SubjectLog, seq: int) -> MessageRecord:
    """One stored message by seq (on the loop: dedup checks and dead-letter listings)."""
    segment, length, offset, _, _ = log.raw(seq)
    payload = reader.read(segment, offset, length)
    record = MessageRecord.decode(payload, path=f"messages/{segment}", offset=offset)
    _check_fields(record.seq, record.subject, log.name, seq, segment, offset)
    return record


def _check_fields(
    found_seq: int, found_subject: str, subject: str, seq: int, segment: int, offset: int
) -> None:
    """A record read through the index must be the one indexed: never serve another."""
    if found_seq != seq or found_subject != subject:
        raise CorruptRecord(
            path=f"messages/{segment}",
            offset=offset,
            reason=f"the index entry of {subject} seq {seq} points at "
            f"{found_subject} seq {found_seq}",
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """What a decision leased: seqs, their attempt numbers and where they are stored."""

    subject: str
    seqs: list[int]
    attempts: list[int]
    positions: list[tuple[int, int, int]]  # (segment, offset, length)
    now_us: int
    # an ordered subject's partition: (subject, partition) to answer instead of the log name
    shown_as: tuple[str, int] | None = None
    records: bool = False  # served as stored (``qmq_wire.records``), not as JSON


def read_batches(
    reader: SegmentReader, batches: list[tuple[Batch, float]]
) -> tuple[list[Read], float]:
    """Runs on a read-pool thread: each batch's records in wire form, and the failures;
    and the CPU seconds this thread spent on them (what the group is charged)."""
    began = time.thread_time()
    reads = [_read_batch(reader, batch, delay_s) for batch, delay_s in batches]
    return reads, time.thread_time() - began


def read_cached(reader: SegmentReader, batches: list[Batch]) -> list[Read]:
    """``read_batches`` on the event loop, for records that are all in the page cache;
    ``NotCached`` as soon as one is not (what was read is dropped: the thread reads it all).

    Most pulls read what was written moments ago. Served on the loop they skip the hand-off
    to a read thread and back, which on a busy loop waits for the GIL."""
    return [_read_batch(reader, batch, 0.0, cached_only=True) for batch in batches]


def read_ahead(reader: SegmentReader, batches: list[Batch]) -> None:
    """Ask the kernel to bring every run of the batches' frames into the page cache, in the
    background: a ``read_cached`` once they are there succeeds without a read thread."""
    for batch in batches:
        for _, _, segment, start, end in _runs(batch.positions):
            reader.read_ahead(segment, start, end - start)


def _read_batch(
    reader: SegmentReader, batch: Batch, delay_s: float, *, cached_only: bool = False
) -> Read:
    if delay_s > 0:
        time.sleep(delay_s)
    if batch.records:
        return _read_records(reader, batch, cached_only)
    payloads = _payloads(reader, batch.positions, cached_only)
    out: list[Served] = []
    unreadable: list[tuple[int, str]] = []
    for seq, attempt, (segment, offset, _), payload in zip(
        batch.seqs, batch.attempts, batch.positions, payloads, strict=True
    ):
        if isinstance(payload, BaseException):
            unreadable.append((seq, str(payload)))
            continue
        try:
            fields = message_fields(payload, path=f"messages/{segment}", offset=offset)
            _check_fields(fields[0], fields[5], batch.subject, seq, segment, offset)
        except CorruptRecord as exc:
            unreadable.append((seq, str(exc)))
            continue
        try:
            message = pulled_fields(fields, attempt=attempt)
        except (ValueError, OverflowError) as exc:
            # Stored by an older broker that did not check what it accepted (a timestamp no
            # answer can carry, a body that is not the UTF-8 it claims): dead-letter that one
            # message; the rest of the batch is served.
            unreadable.append((seq, f"record cannot be served: {exc}"))
            continue
        if batch.shown_as is not None:
            message["subject"], message["partition"] = batch.shown_as
        out.append(message)
    return out, unreadable


def _read_records(reader: SegmentReader, batch: Batch, cached_only: bool) -> Read:
    """``_read_batch`` of a pull answered with records: each record as stored behind its
    attempt and partition, its frame's CRC and its identity (seq, subject) checked, nothing
    else parsed, and each copied once out of the buffer its run was read into.

    Not parsed: what a JSON answer cannot carry (a body that is not the UTF-8 it claims)
    the client reads as bytes.
    """
    partition = None if batch.shown_as is None else batch.shown_as[1]
    subject = batch.subject.encode()
    subject_at = FRAME_SIZE + SUBJECT_AT + 2  # in the frame
    subject_length = len(subject)
    subject_end = subject_at + subject_length
    seqs, attempts, positions = batch.seqs, batch.attempts, batch.positions
    peek = FRAMED_PEEK.unpack_from
    out: list[Served] = []
    unreadable: list[tuple[int, str]] = []
    for i, j, segment, start, end in _runs(positions):
        try:
            data = memoryview(reader.read_run(segment, start, end - start, cached_only=cached_only))
        except (StorageError, OSError) as exc:
            unreadable += [(seq, str(exc)) for seq in seqs[i:j]]
            continue
        for seq, attempt, (_, offset, length) in zip(
            seqs[i:j], attempts[i:j], positions[i:j], strict=True
        ):
            at = offset - start
            record = data[at + FRAME_SIZE : at + length]
            try:
                size, crc, kind, found_seq, _, found_length = peek(data, at)
            except struct.error:
                size = crc = kind = found_seq = found_length = -1
            if (
                size != len(record)
                or crc32(record) != crc
                or kind != RECORD_MESSAGE
                or found_seq != seq
                or found_length != subject_length
                or data[at + subject_at : at + subject_end] != subject
            ):
                # not the indexed record whole: the checks that name what is wrong
                try:
                    payload = read_frame_at(
                        data[at : at + length], offset=offset, path=f"messages/{segment}"
                    )
                    found_seq, _, found_subject, _ = peek_message(payload)
                    _check_fields(found_seq, found_subject, batch.subject, seq, segment, offset)
                except CorruptRecord as exc:
                    unreadable.append((seq, str(exc)))
                    continue
                record = memoryview(payload)  # whole after all (an index longer than its frame)
            out.append(records_entry(attempt, partition, record))
    return out, unreadable


def _payloads(
    reader: SegmentReader, positions: list[tuple[int, int, int]], cached_only: bool
) -> list[bytes | BaseException]:
    """Frame payloads, reading each run of adjacent frames with one ``pread``.

    A batch of a subject's consecutive messages usually sits back to back in one segment;
    one system call per run instead of one per frame also means one GIL hand-off per run.
    """
    out: list[bytes | BaseException] = []
    for i, j, segment, start, end in _runs(positions):
        if j - i == 1:
            try:
                out.append(reader.read(segment, start, end - start, cached_only=cached_only))
            except (StorageError, CorruptRecord, OSError) as exc:
                out.append(exc)
        else:
            out.extend(_run(reader, positions[i:j], start, end, cached_only))
    return out


def _runs(positions: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int, int, int]]:
    """``(i, j, segment, start, end)`` for each run ``positions[i:j]`` of adjacent frames of
    one segment (at most ``MAX_RUN_BYTES``), in order."""
    i = 0
    while i < len(positions):
        segment, start, length = positions[i]
        j = i + 1
        end = start + length
        while j < len(positions) and positions[j][0] == segment and positions[j][1] == end:
            if end + positions[j][2] - start > MAX_RUN_BYTES:
                break
            end += positions[j][2]
            j += 1
        yield i, j, segment, start, end
        i = j


def _run(
    reader: SegmentReader,
    positions: list[tuple[int, int, int]],
    start: int,
    end: int,
    cached_only: bool,
) -> list[bytes | BaseException]:
    path = f"messages/{positions[0][0]}"
    try:
        data = memoryview(
            reader.read_run(positions[0][0], start, end - start, cached_only=cached_only)
        )
    except (StorageError, OSError) as exc:
        return [exc] * len(positions)
    out: list[bytes | BaseException] = []
    for _, offset, length in positions:
        try:
            out.append(
                read_frame_at(
                    data[offset - start : offset - start + length], offset=offset, path=path
                )
            )
        except CorruptRecord as exc:
            out.append(exc)
    return out
