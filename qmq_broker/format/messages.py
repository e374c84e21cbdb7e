"""Message records: one stored message, as framed in the message log.

The layout (``qmq_wire.records``, which also decodes it: records go out as stored to pulls
that accept them) is the fixed fields, the subject, id, key and producer, the JSON headers
and the body. A message with tags sets ``FLAG_TAGS`` and has its tags between its headers
and its body's length. Records without tags never set the flag and are laid out as before
it existed, so every older data directory reads unchanged (no format version).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import orjson

from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import SegmentKind
from qmq_broker.format.frames import FRAME, crc32, iter_records, record_check
from qmq_wire.records import (
    FLAG_BODY_BASE64,
    FLAG_TAGS,
    NONE_LEN,
    RECORD_MESSAGE,
    U16,
    U32,
    MessageFields,
    RecordError,
    decode_message,
)

_MSG_HEAD = struct.Struct("<BBQqqqH")  # the fixed fields and the subject's length
_NO_STRING = U16.pack(NONE_LEN)  # a key or producer that is None
_NO_HEADERS = U32.pack(0)


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
    tags: tuple[str, ...] = ()

    def encode(self) -> bytes:
        return (
            _message_head(
                self.seq, self.id, self.subject, self.key, self.headers, len(self.body),
                self.body_base64, self.producer, self.created_at_us, self.stored_at_us,
                self.deliver_at_us, self.tags,
            )
            + self.body
        )  # fmt: skip

    @classmethod
    def decode(cls, payload: bytes, *, path: str = "?", offset: int = -1) -> MessageRecord:
        (seq, flags, created, stored, deliver, subject, message_id, key, producer, headers, body,
         tags) = message_fields(payload, path=path, offset=offset)  # fmt: skip
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
            tags=tags,
        )


def message_fields(payload: bytes, *, path: str = "?", offset: int = -1) -> MessageFields:
    """A message record's fields as a plain tuple (``qmq_wire.records.MessageFields``).

    ``MessageRecord.decode`` builds its record from this; a pull turns it straight into the
    wire form (``qmq_broker.messages.pulled_fields``), which spares a record per served message.
    ``CorruptRecord`` when the payload does not read as a message.
    """
    try:
        return decode_message(payload, orjson.loads)
    except RecordError as exc:
        raise CorruptRecord(path=path, offset=offset, reason=str(exc)) from exc


_MSG_PEEK = struct.Struct("<BxQ8xq8xH")  # type, seq, stored_us, the subject's length
# a message record's frame (length, CRC) and the same fields, read in one go (a pull's check)
FRAMED_PEEK = struct.Struct(FRAME.format + _MSG_PEEK.format.lstrip("<"))


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
        (id_length,) = U16.unpack_from(payload, at)
        raw_id = payload[at + 2 : at + 2 + id_length]
        if len(raw_subject) != length or id_length == NONE_LEN or len(raw_id) != id_length:
            raise ValueError("string cut short")
        subject, message_id = raw_subject.decode(), raw_id.decode()
    except (struct.error, ValueError) as exc:
        raise CorruptRecord(path="?", offset=-1, reason=str(exc)) from exc
    return seq, stored, subject, message_id


class Framable(Protocol):
    """What ``message_frames`` reads of a message: the broker's ``IncomingMessage``, or a
    ``MessageRecord`` stored again (a due delayed message)."""

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
    @property
    def tags(self) -> tuple[str, ...]: ...


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
    pack_head, pack_u16, pack_u32, pack_frame = _MSG_HEAD.pack, U16.pack, U32.pack, FRAME.pack
    checksum, join = crc32, b"".join
    frames = []
    seq = first_seq
    for message in messages:
        raw_id = message.id.encode()
        key, producer, headers, body = message.key, message.producer, message.headers, message.body
        created = message.created_at_us
        tags = message.tags
        head = join(
            (
                pack_head(
                    RECORD_MESSAGE,
                    (FLAG_BODY_BASE64 if message.body_base64 else 0) | (FLAG_TAGS if tags else 0),
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
                _pack_tags(tags) if tags else b"",
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
    tags: tuple[str, ...] = (),
) -> bytes:
    """A message record up to its body (which follows it): ``MessageRecord.encode``'s head.
    ``message_frames`` packs the same, inline."""
    raw_subject = subject.encode()
    raw_id = message_id.encode()
    return b"".join(
        (
            _MSG_HEAD.pack(
                RECORD_MESSAGE,
                (FLAG_BODY_BASE64 if body_base64 else 0) | (FLAG_TAGS if tags else 0),
                seq,
                created_at_us,
                stored_at_us,
                deliver_at_us,
                len(raw_subject),
            ),
            raw_subject,
            U16.pack(len(raw_id)),
            raw_id,
            _NO_STRING if key is None else _pack_str(key),
            _NO_STRING if producer is None else _pack_str(producer),
            _pack_headers(headers) if headers else _NO_HEADERS,
            _pack_tags(tags) if tags else b"",
            U32.pack(body_length),
        )
    )


def _pack_headers(headers: dict[str, str]) -> bytes:
    raw = orjson.dumps(headers)
    return U32.pack(len(raw)) + raw


def _pack_tags(tags: tuple[str, ...]) -> bytes:
    return _pack_str(",".join(tags))


def _pack_str(value: str) -> bytes:
    raw = value.encode("utf-8")
    return U16.pack(len(raw)) + raw


def read_string(buf: bytes | memoryview | mmap.mmap, pos: int) -> tuple[str, int]:
    """The ``[u16 length][UTF-8]`` string at ``pos`` (not None) and the position after it;
    ``ValueError`` or ``struct.error`` when it does not read."""
    (length,) = U16.unpack_from(buf, pos)
    end = pos + 2 + length
    raw = buf[pos + 2 : end]
    if length == NONE_LEN or len(raw) != length:
        raise ValueError("string cut short or missing")
    return bytes(raw).decode("utf-8"), end


is_message_record = record_check(MessageRecord.decode)
"""A frame check for message segments: the payload decodes as a message record."""


def iter_message_records(path: Path) -> Iterator[tuple[int, MessageRecord]]:
    """Every whole message record of a segment file with its offset."""
    return iter_records(path, SegmentKind.MESSAGES, MessageRecord.decode)
