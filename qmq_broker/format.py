"""On-disk formats of the broker's data directory, readable without the broker running.

Layout of a data directory (format 4)::

    FORMAT                      {"format": 4}
    messages/<20 digits>.seg    message log segments, all subjects, append-only
    actions/<20 digits>.seg     action log segments (leases, acks, retries, dead letters)
    index/<subject>/<20 digits>.idx  a subject's index, seq -> (segment, offset, length),
                                in chunks of INDEX_CHUNK_ENTRIES seqs named by their first
                                seq; a chunk is deleted once retention removed every message
                                it points to
    dedup/<subject>/            the subject's dedup window: sorted runs of id hashes and a
                                filter (``qmq_broker.dedup``)
    schedule/<20 digits>.seg    delayed messages, one segment per hour of their due time
                                (the number is the hour since the Unix epoch), whole messages
    dispatch/<20 digits>.seg    which records of the same-numbered schedule segment went out
    schedule-days/<20 digits>.seg    delayed messages due after the current UTC day, one
                                segment per UTC day (day since the epoch); moved into hours
    schedule-32days/<20 digits>.seg  due further ahead still, one segment per 32 days
                                (32-day span since the epoch); moved into days
    checkpoint.json             positions up to which index and group state are saved
    checkpoint.prev.json        the checkpoint before it (both carry a CRC)

Format 1 kept each subject's whole index in one file, ``index/<subject>.idx``; format 2
split it into chunks; format 3 changed the id hash in index entries and dedup runs from
BLAKE2b-64 to XXH3-64 (``id_hash``); format 4 lets a log segment end in room (below). A
broker migrates an older data directory on start (``qmq_broker.storage.migrate``).

Every segment starts with a 16-byte header (magic, kind, format version) and then holds
frames ``[u32 payload length][u32 crc32(payload)][payload]``. A frame that is cut short
or whose CRC does not match is never returned as a record; ``walk_frames`` reads on past
it (recovery truncates it only when nothing valid follows at the end of the last segment).

**Room** (format 4): the message and action logs' writer allocates its segment files
ahead of its appends (``fallocate``), because an fdatasync that must also record a grown
file costs more than one that does not. So the active segment may end in zero bytes past
its last frame, until the writer fills them, rolls to the next segment or stops (both cut
the room off). No frame has length 0, so where the bytes from a frame's start to the end
of the file are all zero, the log's data ends there: readers stop quietly, and a torn tail
is only what is left of a write that began.

This module is shared by the broker and by ``qmq_reconcile``; it imports nothing from the
server side.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from enum import IntEnum
from pathlib import Path
from typing import Any, Protocol

import orjson
import xxhash

# ISA-L's CRC-32 is zlib's function (same polynomial and values: the format is unchanged) at
# a fifth of its cost on a 1 KiB frame; zlib's took about 4 % of the broker's CPU under load
from isal.isal_zlib import crc32 as crc32  # re-exported: tests hold it to zlib's values

from qmq_broker.errors import CorruptRecord, StorageError

FORMAT_VERSION = 4  # of the data directory's layout (FORMAT, checkpoints, indexes, id hash, room)
SEGMENT_VERSION = 1  # of the segments' frames and records (unchanged since format 1)
SEGMENT_LAYOUT_FORMATS = (1, 2, 3, 4)  # data dir formats whose segments a reader can read
FORMAT_FILE = "FORMAT"  # {"format": N} at the top of a data directory


def read_format(data_dir: Path) -> int | None:
    """The format version ``data_dir``'s FORMAT file names; None when it has none.

    ``StorageError`` when the file cannot be read or does not hold ``{"format": N}``.
    """
    path = data_dir / FORMAT_FILE
    # A damaged FORMAT cannot be rebuilt from the data: the fix names the value this
    # broker writes, for the operator to confirm against the version that last ran here.
    fix = (
        f'if this broker version last ran here, write {{"format": {FORMAT_VERSION}}} into it '
        f"(echo '{{\"format\": {FORMAT_VERSION}}}' > {path}), then run "
        f"qmq broker verify --data-dir {data_dir}"
    )
    try:
        document = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as exc:
        raise StorageError(f"{path} is damaged ({exc}); {fix}") from exc
    except OSError as exc:
        raise StorageError(f"{path} cannot be read: {exc}") from exc
    version = document.get("format") if isinstance(document, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise StorageError(f'{path} does not hold {{"format": N}}; {fix}')
    return version


SEGMENT_MAGIC = b"QMQSEG\x00\x01"
INDEX_MAGIC = b"QMQIDX\x00\x01"
HEADER = struct.Struct("<8sHHI")  # magic, kind, version, reserved
HEADER_SIZE = HEADER.size  # 16
FRAME = struct.Struct("<II")  # payload length, crc32
FRAME_SIZE = FRAME.size
MAX_PAYLOAD = 64 * 1024 * 1024
SEGMENT_SUFFIX = ".seg"
INDEX_SUFFIX = ".idx"
NONE_LEN = 0xFFFF


class SegmentKind(IntEnum):
    MESSAGES = 1
    ACTIONS = 2
    SCHEDULE = 3
    DISPATCH = 4
    SCHEDULE_DAYS = 5
    SCHEDULE_32DAYS = 6


KIND_DIRS = {
    SegmentKind.MESSAGES: "messages",
    SegmentKind.ACTIONS: "actions",
    SegmentKind.SCHEDULE: "schedule",
    SegmentKind.DISPATCH: "dispatch",
    SegmentKind.SCHEDULE_DAYS: "schedule-days",
    SegmentKind.SCHEDULE_32DAYS: "schedule-32days",
}


def segment_header(kind: SegmentKind) -> bytes:
    return HEADER.pack(SEGMENT_MAGIC, int(kind), SEGMENT_VERSION, 0)


def read_segment_header(data: bytes, *, path: str) -> SegmentKind:
    """Check a segment header; raise ``CorruptRecord`` naming the file if it is not ours."""
    if len(data) < HEADER_SIZE:
        raise CorruptRecord(path=path, offset=0, reason="segment header cut short")
    magic, kind, version, _ = HEADER.unpack_from(data, 0)
    if magic != SEGMENT_MAGIC:
        raise CorruptRecord(path=path, offset=0, reason="not a qmq segment (bad magic)")
    if version != SEGMENT_VERSION:
        raise CorruptRecord(path=path, offset=0, reason=f"unsupported format version {version}")
    try:
        return SegmentKind(kind)
    except ValueError:
        raise CorruptRecord(path=path, offset=0, reason=f"unknown segment kind {kind}") from None


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload), crc32(payload)) + payload


def segment_name(number: int) -> str:
    return f"{number:020d}{SEGMENT_SUFFIX}"


def segment_number(path: Path) -> int:
    return int(path.name[: -len(SEGMENT_SUFFIX)])


def list_segments(data_dir: str | os.PathLike[str], kind: SegmentKind) -> list[Path]:
    """Segments of one kind in a data directory, oldest first."""
    folder = Path(data_dir) / KIND_DIRS[kind]
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.name.endswith(SEGMENT_SUFFIX)]
    return sorted(found, key=segment_number)


def iter_frames(data: bytes, *, path: str, start: int = HEADER_SIZE) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, payload)`` for every whole, CRC-valid frame from ``start``.

    Stops at the first frame that is cut short or fails its CRC; ``walk_frames`` reads on
    past it and says where and why.
    """
    for offset, payload in _frames(data, start):
        if payload is None:
            return
        yield offset, payload


def _frames(data: bytes, start: int) -> Iterator[tuple[int, bytes | None]]:
    view = memoryview(data)
    size = len(data)
    offset = start
    while offset < size:
        if offset + FRAME_SIZE > size:
            yield offset, None
            return
        length, crc = FRAME.unpack_from(data, offset)
        body_start = offset + FRAME_SIZE
        if length == 0 or length > MAX_PAYLOAD or body_start + length > size:
            yield offset, None
            return
        payload = bytes(view[body_start : body_start + length])
        if crc32(payload) != crc:
            yield offset, None
            return
        yield offset, payload
        offset = body_start + length


@dataclasses.dataclass(frozen=True, slots=True)
class BadRegion:
    """Bytes of a segment that hold no readable frame: ``[start, end)``.

    ``end`` is where the next valid frame starts, or the end of the data when none follows
    (then the region is a torn tail if the segment is the last one).
    """

    start: int
    end: int
    torn: bool  # no valid frame follows: a torn tail, if the segment is the last one

    @property
    def reason(self) -> str:
        if self.torn:
            return f"torn or corrupt frame at offset {self.start}; nothing valid follows"
        return f"corrupt bytes [{self.start}, {self.end}); valid frames follow"


FrameCheck = Callable[[bytes], bool]


def walk_frames(
    data: bytes, *, start: int = HEADER_SIZE, check: FrameCheck | None = None
) -> Iterator[tuple[int, bytes] | BadRegion]:
    """Every valid frame from ``start`` as ``(offset, payload)``, and every bad region between.

    Frames in sequence are trusted by their CRC. After a frame that is cut short or fails
    its CRC, the walk resynchronises: it looks for the next offset where a whole frame with
    a matching CRC starts, whose payload passes ``check`` (e.g. decodes as a record of the
    segment's kind), and whose end is followed by another valid frame or by the end of the
    data. So one flipped bit costs the frame it hit, not every frame after it, and a torn
    tail is a bad region with no valid frame after it (``BadRegion.torn``). Zero bytes from
    where a frame should start to the end are the writer's room, not a region: the walk
    ends there.
    """
    size = len(data)
    offset = start
    while offset < size:
        payload = _frame_at(data, offset, size)
        if payload is not None:
            yield offset, payload
            offset += FRAME_SIZE + len(payload)
            continue
        if _all_zero(data, offset, size):
            return
        following = next_valid_frame(data, offset + 1, size, check)
        if following is None:
            yield BadRegion(offset, size, torn=True)
            return
        yield BadRegion(offset, following, torn=False)
        offset = following


_NONZERO = re.compile(rb"[^\x00]")


def _all_zero(data: bytes | mmap.mmap, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` is all zero bytes (room), read without a copy."""
    return _NONZERO.search(data, start, end) is None


def _frame_at(data: bytes | mmap.mmap, offset: int, size: int) -> bytes | None:
    if offset + FRAME_SIZE > size:
        return None
    length, crc = FRAME.unpack_from(data, offset)
    body_start = offset + FRAME_SIZE
    if length == 0 or length > MAX_PAYLOAD or body_start + length > size:
        return None
    payload = data[body_start : body_start + length]
    return payload if crc32(payload) == crc else None


def next_valid_frame(
    data: bytes | mmap.mmap, offset: int, size: int, check: FrameCheck | None
) -> int | None:
    """The first offset in ``[offset, size)`` where a whole, CRC-valid frame starts whose
    payload passes ``check`` and which is followed by another valid frame, ``size`` or only
    zero bytes (room). Runs of zero bytes are skipped whole: no frame's length is 0."""
    while offset + FRAME_SIZE <= size:
        (length,) = _U32.unpack_from(data, offset)
        if length == 0:
            nonzero = _NONZERO.search(data, offset + 4, size)
            if nonzero is None:
                return None
            # a frame starts at most 3 bytes before its length's first nonzero byte
            offset = max(offset + 1, nonzero.start() - 3)
            continue
        payload = _frame_at(data, offset, size)
        if payload is not None and (check is None or check(payload)):
            after = offset + FRAME_SIZE + len(payload)
            if (
                after == size
                or _frame_at(data, after, size) is not None
                or _all_zero(data, after, size)
            ):
                return offset
        offset += 1
    return None


def is_message_record(payload: bytes) -> bool:
    """A frame check for message segments: the payload decodes as a message record."""
    try:
        MessageRecord.decode(payload)
    except CorruptRecord:
        return False
    return True


def is_schedule_record(payload: bytes) -> bool:
    """A frame check for schedule segments: the payload decodes as a schedule record."""
    try:
        ScheduleRecord.decode(payload)
    except CorruptRecord:
        return False
    return True


def is_dispatch_record(payload: bytes) -> bool:
    """A frame check for dispatch segments: the payload decodes as a dispatch record."""
    try:
        DispatchRecord.decode(payload)
    except CorruptRecord:
        return False
    return True


def is_action_record(payload: bytes) -> bool:
    """A frame check for action-log segments: the payload decodes as an action record."""
    try:
        ActionRecord.decode(payload)
    except CorruptRecord:
        return False
    return True


def read_frame_at(data: bytes | memoryview, *, offset: int, path: str) -> bytes:
    """Read one frame at a known offset, verifying its CRC."""
    if len(data) < FRAME_SIZE:
        raise CorruptRecord(path=path, offset=offset, reason="frame header cut short")
    length, crc = FRAME.unpack_from(data, 0)
    payload = bytes(data[FRAME_SIZE : FRAME_SIZE + length])
    if len(payload) != length:
        raise CorruptRecord(path=path, offset=offset, reason="frame cut short")
    if crc32(payload) != crc:
        raise CorruptRecord(path=path, offset=offset, reason="CRC mismatch")
    return payload


# --- message records -------------------------------------------------------------------

_MSG_FIXED = struct.Struct("<BBQqqq")  # type, flags, seq, created_us, stored_us, deliver_us
_MSG_HEAD = struct.Struct("<BBQqqqH")  # the fixed fields and the subject's length
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_NO_STRING = _U16.pack(0xFFFF)  # NONE_LEN: a key or producer that is None
_NO_HEADERS = _U32.pack(0)
RECORD_MESSAGE = 1
FLAG_BODY_BASE64 = 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MessageRecord:
    """One stored message, as framed in the message log."""

    seq: int
    id: str
    subject: str
    key: str | None
    headers: dict[str, str]
    body: bytes
    body_base64: bool
    producer: str | None
    created_at_us: int
    stored_at_us: int
    deliver_at_us: int  # 0: delivered on arrival

    def encode(self) -> bytes:
        return (
            _message_head(
                self.seq, self.id, self.subject, self.key, self.headers, len(self.body),
                self.body_base64, self.producer, self.created_at_us, self.stored_at_us,
                self.deliver_at_us,
            )
            + self.body
        )  # fmt: skip

    @classmethod
    def decode(cls, payload: bytes, *, path: str = "?", offset: int = -1) -> MessageRecord:
        seq, flags, created, stored, deliver, subject, message_id, key, producer, headers, body = (
            message_fields(payload, path=path, offset=offset)
        )
        return cls(
            seq=seq,
            id=message_id,
            subject=subject,
            key=key,
            headers=headers,
            body=body,
            body_base64=bool(flags & FLAG_BODY_BASE64),
            producer=producer,
            created_at_us=created,
            stored_at_us=stored,
            deliver_at_us=deliver,
        )


MessageFields = tuple[
    int, int, int, int, int, str, str, "str | None", "str | None", dict[str, str], bytes
]


def message_fields(payload: bytes, *, path: str = "?", offset: int = -1) -> MessageFields:
    """A message record's fields as a plain tuple: ``(seq, flags, created_us, stored_us,
    deliver_us, subject, id, key, producer, headers, body)``.

    ``MessageRecord.decode`` builds its record from this; a pull turns it straight into the
    wire form (``qmq_broker.messages.pulled_fields``), which spares a record per served message.
    ``CorruptRecord`` when the payload does not read as a message.
    """
    # Unrolled, with no helper calls: a pull decodes every message it serves. Positions
    # advance by the declared lengths; a length that overruns the payload makes a later
    # unpack fail or the final sum miss, so one check at the end covers every field.
    u16 = _U16.unpack_from
    try:
        kind, flags, seq, created, stored, deliver = _MSG_FIXED.unpack_from(payload, 0)
        if kind != RECORD_MESSAGE:
            raise ValueError(f"record type {kind} is not a message")
        pos = _MSG_FIXED.size
        (length,) = u16(payload, pos)
        subject = None if length == NONE_LEN else payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 if length == NONE_LEN else 2 + length
        (length,) = u16(payload, pos)
        message_id = None if length == NONE_LEN else payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 if length == NONE_LEN else 2 + length
        (length,) = u16(payload, pos)
        key = None if length == NONE_LEN else payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 if length == NONE_LEN else 2 + length
        (length,) = u16(payload, pos)
        producer = None if length == NONE_LEN else payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 if length == NONE_LEN else 2 + length
        (hlen,) = _U32.unpack_from(payload, pos)
        pos += 4
        headers = orjson.loads(payload[pos : pos + hlen]) if hlen else {}
        pos += hlen
        (blen,) = _U32.unpack_from(payload, pos)
        pos += 4
        if pos + blen != len(payload) or subject is None:
            raise ValueError("lengths do not add up")
        if message_id is None:
            raise ValueError("message without id")
    except (struct.error, ValueError, orjson.JSONDecodeError) as exc:
        raise CorruptRecord(path=path, offset=offset, reason=str(exc)) from exc
    body = payload[pos:]
    return seq, flags, created, stored, deliver, subject, message_id, key, producer, headers, body


_MSG_PEEK = struct.Struct("<BxQ8xq8xH")  # type, seq, stored_us, the subject's length


def peek_message(payload: bytes) -> tuple[int, int, str, str]:
    """``(seq, stored_at_us, subject, id)`` of a message record, decoding nothing else
    (recovery indexes the log with it); ``CorruptRecord`` when they do not read."""
    try:
        kind, seq, stored, length = _MSG_PEEK.unpack_from(payload, 0)
        if kind != RECORD_MESSAGE or length == NONE_LEN:
            raise ValueError("not a message record")
        at = _MSG_PEEK.size
        raw_subject = payload[at : at + length]
        at += length
        (id_length,) = _U16.unpack_from(payload, at)
        raw_id = payload[at + 2 : at + 2 + id_length]
        if len(raw_subject) != length or id_length == NONE_LEN or len(raw_id) != id_length:
            raise ValueError("string cut short")
        subject, message_id = raw_subject.decode(), raw_id.decode()
    except (struct.error, ValueError) as exc:
        raise CorruptRecord(path="?", offset=-1, reason=str(exc)) from exc
    return seq, stored, subject, message_id


class Framable(Protocol):
    """What ``message_frames`` reads of a message (the broker's ``IncomingMessage``)."""

    @property
    def id(self) -> str: ...
    @property
    def key(self) -> str | None: ...
    @property
    def headers(self) -> dict[str, str]: ...
    @property
    def body(self) -> bytes: ...
    @property
    def body_base64(self) -> bool: ...
    @property
    def producer(self) -> str | None: ...
    @property
    def created_at_us(self) -> int | None: ...
    @property
    def deliver_at_us(self) -> int: ...


def message_frames(
    messages: Iterable[Framable], *, subject: str, first_seq: int, stored_at_us: int
) -> list[bytes]:
    """``frame(record.encode())`` of each message as the next seqs of ``subject`` from
    ``first_seq``, stored at ``stored_at_us`` (also its created time when it has none): the
    produce path's framing, one loop over a batch with no call per message but the packing
    (``MessageRecord.encode`` is the layout's reference). Each body is copied once, and the
    CRC runs over the head and then the body."""
    raw_subject = subject.encode()
    subject_length = len(raw_subject)
    pack_head, pack_u16, pack_u32, pack_frame = _MSG_HEAD.pack, _U16.pack, _U32.pack, FRAME.pack
    checksum, join = crc32, b"".join
    frames = []
    seq = first_seq
    for message in messages:
        raw_id = message.id.encode()
        key, producer, headers, body = message.key, message.producer, message.headers, message.body
        created = message.created_at_us
        head = join(
            (
                pack_head(
                    RECORD_MESSAGE,
                    FLAG_BODY_BASE64 if message.body_base64 else 0,
                    seq,
                    stored_at_us if created is None else created,
                    stored_at_us,
                    message.deliver_at_us,
                    subject_length,
                ),
                raw_subject,
                pack_u16(len(raw_id)),
                raw_id,
                _NO_STRING if key is None else _pack_str(key),
                _NO_STRING if producer is None else _pack_str(producer),
                _pack_headers(headers) if headers else _NO_HEADERS,
                pack_u32(len(body)),
            )
        )
        frames.append(
            join((pack_frame(len(head) + len(body), checksum(body, checksum(head))), head, body))
        )
        seq += 1
    return frames


def _message_head(
    seq: int,
    message_id: str,
    subject: str,
    key: str | None,
    headers: dict[str, str],
    body_length: int,
    body_base64: bool,
    producer: str | None,
    created_at_us: int,
    stored_at_us: int,
    deliver_at_us: int,
) -> bytes:
    """A message record up to its body (which follows it): ``MessageRecord.encode``'s head.
    ``message_frames`` packs the same, inline."""
    raw_subject = subject.encode()
    raw_id = message_id.encode()
    return b"".join(
        (
            _MSG_HEAD.pack(
                RECORD_MESSAGE,
                FLAG_BODY_BASE64 if body_base64 else 0,
                seq,
                created_at_us,
                stored_at_us,
                deliver_at_us,
                len(raw_subject),
            ),
            raw_subject,
            _U16.pack(len(raw_id)),
            raw_id,
            _NO_STRING if key is None else _pack_str(key),
            _NO_STRING if producer is None else _pack_str(producer),
            _pack_headers(headers) if headers else _NO_HEADERS,
            _U32.pack(body_length),
        )
    )


def _pack_headers(headers: dict[str, str]) -> bytes:
    raw = orjson.dumps(headers)
    return _U32.pack(len(raw)) + raw


def _pack_str(value: str | None) -> bytes:
    if value is None:
        return _U16.pack(NONE_LEN)
    raw = value.encode("utf-8")
    return _U16.pack(len(raw)) + raw


_XXH3_64 = xxhash.xxh3_64_intdigest


def id_hash(message_id: str) -> int:
    """64-bit hash of a message id: XXH3-64 (seed 0) of its UTF-8 bytes, kept in the index
    and the dedup runs (format 3; formats 1 and 2 used BLAKE2b-64, ten times the cost)."""
    return _XXH3_64(message_id.encode())


# --- subject index ---------------------------------------------------------------------

INDEX_ENTRY = struct.Struct("<IIQqQ")  # segment, frame length, offset, stored_us, id hash
INDEX_ENTRY_SIZE = INDEX_ENTRY.size  # 32
INDEX_HEADER = struct.Struct("<8sHHI")  # magic, version, entry size, CRC-32 once sealed
INDEX_VERSION = 2  # 1: one file per subject, the reserved field always 0
INDEX_CHUNK_ENTRIES = 16384  # seqs per index file (512 KiB of entries)
"""Chunk ``k`` of a subject holds seqs ``[k * INDEX_CHUNK_ENTRIES, (k + 1) * ...)``. Once
full it is sealed: the CRC-32 of its entries goes into its header (0 before that)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IndexEntry:
    """Where message ``seq`` of a subject lives in the message log."""

    segment: int
    offset: int
    length: int
    stored_at_us: int
    id_hash: int

    def encode(self) -> bytes:
        return INDEX_ENTRY.pack(
            self.segment, self.length, self.offset, self.stored_at_us, self.id_hash
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview, at: int = 0) -> IndexEntry:
        segment, length, offset, stored, hashed = INDEX_ENTRY.unpack_from(raw, at)
        return cls(
            segment=segment, offset=offset, length=length, stored_at_us=stored, id_hash=hashed
        )


def index_header(sealed_crc: int = 0) -> bytes:
    return INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, INDEX_ENTRY_SIZE, sealed_crc)


def chunk_start(seq: int) -> int:
    """The first seq of the index chunk holding ``seq``."""
    return seq - seq % INDEX_CHUNK_ENTRIES


def index_dir(data_dir: str | os.PathLike[str], subject: str) -> Path:
    return Path(data_dir) / "index" / subject


def index_chunk_path(data_dir: str | os.PathLike[str], subject: str, start: int) -> Path:
    return index_dir(data_dir, subject) / f"{start:020d}{INDEX_SUFFIX}"


def list_index_chunks(data_dir: str | os.PathLike[str], subject: str) -> list[int]:
    """The first seqs of a subject's index chunks on disk, ascending."""
    folder = index_dir(data_dir, subject)
    if not folder.is_dir():
        return []
    return sorted(
        int(path.name[: -len(INDEX_SUFFIX)])
        for path in folder.iterdir()
        if path.name.endswith(INDEX_SUFFIX) and path.name[: -len(INDEX_SUFFIX)].isdigit()
    )


def list_indexed_subjects(data_dir: str | os.PathLike[str]) -> list[str]:
    folder = Path(data_dir) / "index"
    if not folder.is_dir():
        return []
    return sorted(path.name for path in folder.iterdir() if path.is_dir())


# --- action records --------------------------------------------------------------------


class ActionType(IntEnum):
    GROUP = 1  # a group (or broadcast consumer) first seen: start position and mode
    LEASE = 2  # seqs leased to a consumer with their attempt numbers and deadline
    ACK = 3  # seqs finished
    RETRY = 4  # seqs to be delivered again no earlier than `due`
    DEAD = 5  # seqs moved to dead letters with an error
    REDRIVE = 6  # dead seqs put back for delivery


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActionRecord:
    """One change of a consumer group's state, as framed in the action log.

    ``state`` names the state owner: the group itself in shared mode, or one consumer of
    the group in broadcast mode (each broadcast consumer has its own cursor).
    """

    type: ActionType
    at_us: int
    subject: str
    group: str
    state: str = ""
    seqs: tuple[int, ...] = ()
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "t": self.at_us,
            "s": self.subject,
            "g": self.group,
            "q": self.seqs,
        }
        if self.state:
            doc["c"] = self.state
        if self.fields:
            doc["f"] = self.fields
        return bytes([int(self.type)]) + orjson.dumps(doc)

    @classmethod
    def decode(cls, payload: bytes, *, path: str = "?", offset: int = -1) -> ActionRecord:
        try:
            kind = ActionType(payload[0])
            doc = orjson.loads(payload[1:])
            return cls(
                type=kind,
                at_us=int(doc["t"]),
                subject=str(doc["s"]),
                group=str(doc["g"]),
                state=str(doc.get("c", "")),
                seqs=tuple(int(s) for s in doc["q"]),
                fields=dict(doc.get("f", {})),
            )
        except (IndexError, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
            raise CorruptRecord(path=path, offset=offset, reason=str(exc)) from exc


# --- readers for tools (qmq_reconcile, tests) -----------------------------------------


def read_segment(path: Path) -> tuple[bytes, SegmentKind]:
    data = path.read_bytes()
    return data, read_segment_header(data, path=str(path))


def iter_message_records(path: Path) -> Iterator[tuple[int, MessageRecord]]:
    """Every whole message record of a segment file with its offset."""
    data, kind = read_segment(path)
    if kind is not SegmentKind.MESSAGES:
        raise CorruptRecord(path=str(path), offset=0, reason=f"a {kind.name} segment")
    for offset, payload in iter_frames(data, path=str(path)):
        yield offset, MessageRecord.decode(payload, path=str(path), offset=offset)


def iter_action_records(path: Path) -> Iterator[tuple[int, ActionRecord]]:
    """Every whole action record of a segment file with its offset."""
    data, kind = read_segment(path)
    if kind is not SegmentKind.ACTIONS:
        raise CorruptRecord(path=str(path), offset=0, reason=f"a {kind.name} segment")
    for offset, payload in iter_frames(data, path=str(path)):
        yield offset, ActionRecord.decode(payload, path=str(path), offset=offset)


# --- schedule and dispatch records ----------------------------------------------------

HOUR_US = 3_600_000_000
_SCHED_FIXED = struct.Struct("<BBqQ")  # type, flags, deliver_us, schedule key
SCHEDULE_FIXED_SIZE = _SCHED_FIXED.size
_DISPATCH_FIXED = struct.Struct("<BqI")  # type, at_us, count
_DISPATCH_ITEM = struct.Struct("<Qq")  # schedule offset, seq stored as (-1: already stored)
RECORD_SCHEDULE = 2
RECORD_DISPATCH = 3


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
        pos = at + SCHEDULE_FIXED_SIZE + _MSG_FIXED.size
        try:
            (length,) = _U16.unpack_from(buf, pos)
            raw = buf[pos + 2 : pos + 2 + length]
            if length == NONE_LEN or len(raw) != length:
                raise ValueError("subject cut short or missing")
            return bytes(raw).decode("utf-8")
        except (struct.error, ValueError) as exc:
            raise CorruptRecord(path=path, offset=offset, reason=str(exc)) from exc

    @staticmethod
    def identity(buf: bytes | memoryview | mmap.mmap, at: int = 0) -> tuple[str, str] | None:
        """``(subject, id)`` of a possibly damaged schedule payload at ``at``, or None.

        Only when both read and hash to the record's key: so a record whose CRC failed can
        still be named when the damage lies elsewhere in it (its body, say).
        """
        try:
            _, key = ScheduleRecord.peek(buf, at)
            subject = ScheduleRecord.peek_subject(buf, at)
            pos = at + SCHEDULE_FIXED_SIZE + _MSG_FIXED.size + 2 + len(subject.encode())
            (length,) = _U16.unpack_from(buf, pos)
            raw = bytes(buf[pos + 2 : pos + 2 + length])
            message_id = raw.decode("utf-8") if len(raw) == length else None
        except (CorruptRecord, struct.error, UnicodeDecodeError):
            return None
        if message_id is None or schedule_key(subject, message_id) != key:
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


def iter_dispatch_records(path: Path) -> Iterator[tuple[int, DispatchRecord]]:
    """Every whole dispatch record of a segment file with its offset."""
    data, kind = read_segment(path)
    if kind is not SegmentKind.DISPATCH:
        raise CorruptRecord(path=str(path), offset=0, reason=f"a {kind.name} segment")
    for offset, payload in iter_frames(data, path=str(path)):
        yield offset, DispatchRecord.decode(payload, path=str(path), offset=offset)
