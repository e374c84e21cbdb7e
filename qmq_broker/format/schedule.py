"""Schedule and dispatch records: delayed messages and which of them went out.

``schedule/<hour>.seg`` (and the coarser ``schedule-days``, ``schedule-32days``) hold
whole messages by due time; ``dispatch/<hour>.seg`` records which records of the
same-numbered schedule segment were appended to their subjects. ``schedule/tallies`` says
of each schedule segment (of every width) how long it was and how many records it held
when last written (``BucketTally``, one fixed-size slot each, an all-zero slot free): the
evidence by which recovery counts the records a cut of a segment took, which the segment
itself no longer holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import SegmentKind
from qmq_broker.format.frames import iter_records, record_check
from qmq_broker.format.messages import MessageRecord, read_string
from qmq_wire.records import SUBJECT_AT

HOUR_US = 3_600_000_000
_SCHED_FIXED = struct.Struct("<BBqQ")  # type, flags, deliver_us, schedule key
SCHEDULE_FIXED_SIZE = _SCHED_FIXED.size
_DISPATCH_FIXED = struct.Struct("<BqI")  # type, at_us, count
_DISPATCH_ITEM = struct.Struct("<Qq")  # schedule offset, seq stored as (-1: already stored)
RECORD_SCHEDULE = 2
RECORD_DISPATCH = 3
TALLIES_FILE = "tallies"  # in the schedule directory
_TALLY = struct.Struct("<BBHiqQQ")  # kind, version, reserved, reserved, bucket, end, records
_TALLY_CRC = struct.Struct("<I")
TALLY_VERSION = 1
TALLY_SIZE = _TALLY.size + _TALLY_CRC.size  # one slot of the tallies file
EMPTY_TALLY = bytes(TALLY_SIZE)


# Schedule buckets, finest first, with their width in hours. A bucket's segment number is
# its index at that width since the Unix epoch (an hour's is the hour since the epoch).
# Only hours are loaded into the timing wheel; the coarser buckets hold messages due far
# ahead and are moved into finer ones before their time comes (``qmq_broker.delayed.tiers``),
# so a sparse schedule costs a file per occupied day or 32 days rather than per hour.
SCHEDULE_BUCKET_HOURS = {
    SegmentKind.SCHEDULE: 1,
    SegmentKind.SCHEDULE_DAYS: 24,
    SegmentKind.SCHEDULE_32DAYS: 32 * 24,
}
SCHEDULE_KINDS = tuple(SCHEDULE_BUCKET_HOURS)
COARSE_SCHEDULE_KINDS = SCHEDULE_KINDS[1:]


def hour_bucket(deliver_at_us: int) -> int:
    """The schedule segment (hour since the Unix epoch) a due time belongs to."""
    return deliver_at_us // HOUR_US


def bucket_width_us(kind: SegmentKind) -> int:
    return SCHEDULE_BUCKET_HOURS[kind] * HOUR_US


def schedule_bucket(kind: SegmentKind, deliver_at_us: int) -> int:
    """The segment number of the ``kind`` bucket a due time belongs to."""
    return deliver_at_us // bucket_width_us(kind)


def bucket_start_us(kind: SegmentKind, bucket: int) -> int:
    return bucket * bucket_width_us(kind)


def schedule_key(subject: str, message_id: str) -> int:
    """64-bit hash of (subject, id): the dedup key of a scheduled message."""
    raw = subject.encode() + b"\x00" + message_id.encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRecord:
    """A delayed message as framed in its hour's schedule segment.

    ``message`` is the whole message as it will be stored when due (``seq`` 0,
    ``stored_at_us`` = when it was accepted, ``deliver_at_us`` = when it is due), so the
    schedule log does not depend on the message log's retention.
    """

    message: MessageRecord
    key: int  # schedule_key(subject, id)

    @property
    def deliver_at_us(self) -> int:
        return self.message.deliver_at_us

    def encode(self) -> bytes:
        fixed = _SCHED_FIXED.pack(RECORD_SCHEDULE, 0, self.message.deliver_at_us, self.key)
        return fixed + self.message.encode()

    @classmethod
    def decode(cls, payload: bytes, *, path: str = "?", offset: int = -1) -> ScheduleRecord:
        deliver, key = cls.peek(payload, path=path, offset=offset)
        message = MessageRecord.decode(payload[SCHEDULE_FIXED_SIZE:], path=path, offset=offset)
        if message.deliver_at_us != deliver:
            raise CorruptRecord(path=path, offset=offset, reason="due times do not agree")
        return cls(message=message, key=key)

    @staticmethod
    def peek(
        buf: bytes | memoryview | mmap.mmap, at: int = 0, *, path: str = "?", offset: int = -1
    ) -> tuple[int, int]:
        """``(deliver_at_us, key)`` of the payload at ``at``, decoding nothing else."""
        try:
            kind, _, deliver, key = _SCHED_FIXED.unpack_from(buf, at)
        except struct.error as exc:
            raise CorruptRecord(path=path, offset=offset, reason=str(exc)) from exc
        if kind != RECORD_SCHEDULE:
            raise CorruptRecord(path=path, offset=offset, reason=f"record type {kind}")
        return deliver, key

    @staticmethod
    def peek_subject(
        buf: bytes | memoryview | mmap.mmap, at: int = 0, *, path: str = "?", offset: int = -1
    ) -> str:
        """The subject of the schedule payload at ``at``, decoding nothing else."""
        try:
            subject, _ = read_string(buf, at + SCHEDULE_FIXED_SIZE + SUBJECT_AT)
        except (struct.error, ValueError) as exc:
            raise CorruptRecord(path=path, offset=offset, reason=f"subject: {exc}") from exc
        return subject

    @staticmethod
    def identity(buf: bytes | memoryview | mmap.mmap, at: int = 0) -> tuple[str, str] | None:
        """``(subject, id)`` of a possibly damaged schedule payload at ``at``, or None.

        Only when both read and hash to the record's key: so a record whose CRC failed can
        still be named when the damage lies elsewhere in it (its body, say).
        """
        try:
            _, key = ScheduleRecord.peek(buf, at)
            subject, pos = read_string(buf, at + SCHEDULE_FIXED_SIZE + SUBJECT_AT)
            message_id, _ = read_string(buf, pos)
        except (CorruptRecord, struct.error, ValueError):
            return None
        if schedule_key(subject, message_id) != key:
            return None
        return subject, message_id


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DispatchRecord:
    """Records of one schedule segment that were appended to their subjects.

    ``offsets[i]`` is a record's offset in the schedule segment of the same number;
    ``seqs[i]`` the seq it got, or -1 when the message log already held it (a dispatch
    repeated after a crash, answered as a duplicate and not stored again), or -2 when the
    schedule record could not be read back (logged and dropped, never served).
    """

    at_us: int
    offsets: tuple[int, ...]
    seqs: tuple[int, ...]

    def encode(self) -> bytes:
        if len(self.offsets) != len(self.seqs):
            raise ValueError("offsets and seqs differ in length")
        head = _DISPATCH_FIXED.pack(RECORD_DISPATCH, self.at_us, len(self.offsets))
        items = b"".join(
            _DISPATCH_ITEM.pack(o, s) for o, s in zip(self.offsets, self.seqs, strict=True)
        )
        return head + items

    @classmethod
    def decode(cls, payload: bytes, *, path: str = "?", offset: int = -1) -> DispatchRecord:
        try:
            kind, at_us, count = _DISPATCH_FIXED.unpack_from(payload, 0)
            if kind != RECORD_DISPATCH:
                raise ValueError(f"record type {kind} is not a dispatch")
            if len(payload) != _DISPATCH_FIXED.size + count * _DISPATCH_ITEM.size:
                raise ValueError("lengths do not add up")
            items = list(_DISPATCH_ITEM.iter_unpack(payload[_DISPATCH_FIXED.size :]))
        except (struct.error, ValueError) as exc:
            raise CorruptRecord(path=path, offset=offset, reason=str(exc)) from exc
        return cls(
            at_us=at_us,
            offsets=tuple(o for o, _ in items),
            seqs=tuple(s for _, s in items),
        )


is_schedule_record = record_check(ScheduleRecord.decode)
"""A frame check for schedule segments: the payload decodes as a schedule record."""

is_dispatch_record = record_check(DispatchRecord.decode)
"""A frame check for dispatch segments: the payload decodes as a dispatch record."""


def iter_dispatch_records(path: Path) -> Iterator[tuple[int, DispatchRecord]]:
    """Every whole dispatch record of a segment file with its offset."""
    return iter_records(path, SegmentKind.DISPATCH, DispatchRecord.decode)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BucketTally:
    """A schedule segment's length and record count, as last written in its slot.

    Written after every batch that appended to the segment (after its fsync under
    ``--fsync always``), in place, with a CRC: so it never claims more than the segment
    held durably, and a segment found shorter than its tally lost ``records`` minus the
    records it still holds. ``kind`` and ``bucket`` name the segment.
    """

    kind: SegmentKind
    bucket: int
    end: int
    records: int

    @property
    def key(self) -> tuple[SegmentKind, int]:
        return self.kind, self.bucket

    def encode(self) -> bytes:
        head = _TALLY.pack(int(self.kind), TALLY_VERSION, 0, 0, self.bucket, self.end, self.records)
        return head + _TALLY_CRC.pack(zlib.crc32(head))

    @classmethod
    def decode(cls, slot: bytes, *, path: str = "?", offset: int = 0) -> BucketTally | None:
        """The tally in a slot, None for a free slot; ``CorruptRecord`` if it is damaged."""
        if slot == EMPTY_TALLY:
            return None
        if len(slot) != TALLY_SIZE:
            raise CorruptRecord(path=path, offset=offset, reason="a tally slot cut short")
        kind, version, _, _, bucket, end, records = _TALLY.unpack_from(slot, 0)
        (crc,) = _TALLY_CRC.unpack_from(slot, _TALLY.size)
        if zlib.crc32(slot[: _TALLY.size]) != crc:
            raise CorruptRecord(path=path, offset=offset, reason="tally CRC mismatch")
        if version != TALLY_VERSION:
            raise CorruptRecord(path=path, offset=offset, reason=f"tally version {version}")
        try:
            segment_kind = SegmentKind(kind)
        except ValueError:
            raise CorruptRecord(path=path, offset=offset, reason=f"kind {kind}") from None
        return cls(kind=segment_kind, bucket=bucket, end=end, records=records)


def read_tallies(path: Path, problems: list[str]) -> dict[tuple[SegmentKind, int], BucketTally]:
    """Every tally of a tallies file by segment (a damaged slot noted in ``problems`` and
    passed over: it costs only the evidence for its segment)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    found: dict[tuple[SegmentKind, int], BucketTally] = {}
    for at in range(0, len(data) - len(data) % TALLY_SIZE, TALLY_SIZE):
        try:
            tally = BucketTally.decode(data[at : at + TALLY_SIZE], path=str(path), offset=at)
        except CorruptRecord as exc:
            problems.append(f"{path} at {at}: {exc.reason}; one segment's tally passed over")
            continue
        if tally is not None:
            key = (tally.kind, tally.bucket)
            if key not in found or found[key].records < tally.records:
                found[key] = tally
    return found
