"""Message records, and pull answers that carry them as stored (``docs/architecture.md`` 3.1).

A message record is ``[u8 type][u8 flags][u64 seq][i64 created_us][i64 stored_us][i64
deliver_us]``, then the subject, id, key and producer (each ``[u16 length][UTF-8]``, length
0xFFFF for None), ``[u32 length][JSON headers]``, with ``FLAG_TAGS`` ``[u16 length][tags
joined by ","]``, and ``[u32 length][body]``. The broker stores messages so (its message
log frames each record with a length and a CRC) and, to a pull that accepts
``RECORDS_MEDIA_TYPE``, answers them so: the records as read, each behind its attempt and
partition, with no JSON per message on either side.

Pure, like the rest of ``qmq_wire``: the JSON of headers and of an answer's fields is
parsed by the ``loads`` each caller passes in.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

RECORDS_MEDIA_TYPE = "application/vnd.qmq.records"
RECORD_MESSAGE = 1
FLAG_BODY_BASE64 = 1  # the body was produced base64-encoded (it is stored decoded)
FLAG_TAGS = 2  # a tags field follows the headers (``qmq_wire.TAG_PATTERN`` has no comma)
NONE_LEN = 0xFFFF  # the length of a string that is None
MSG_FIXED = struct.Struct("<BBQqqq")  # type, flags, seq, created_us, stored_us, deliver_us
SUBJECT_AT = MSG_FIXED.size  # where a message record's subject (its u16 length) starts
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")

# A records answer: magic and version, the answer's other fields as JSON, the count, then
# per message ``[u32 attempt][i32 partition, -1 for none][u32 length][record]``.
_ANSWER_MAGIC = b"QMQR\x01"
_ENTRY = struct.Struct("<IiI")

MessageFields = tuple[
    int,  # seq
    int,  # flags
    int,  # created_us
    int,  # stored_us
    int,  # deliver_us
    str,  # subject
    str,  # id
    "str | None",  # key
    "str | None",  # producer
    dict[str, str],  # headers
    bytes,  # body
    tuple[str, ...],  # tags
]


class RecordError(ValueError):
    """A message record or a records answer that does not read."""


def decode_message(payload: bytes, loads: Callable[[bytes], Any]) -> MessageFields:
    """A message record's fields as a plain tuple (see ``MessageFields``); ``RecordError``
    when the payload does not read as one."""
    # Unrolled, with no helper calls: a pull decodes every message it serves. Positions
    # advance by the declared lengths; a length that overruns the payload makes a later
    # unpack fail or the final sum miss, so one check at the end covers every field.
    u16 = U16.unpack_from
    try:
        kind, flags, seq, created, stored, deliver = MSG_FIXED.unpack_from(payload, 0)
        if kind != RECORD_MESSAGE:
            raise ValueError(f"record type {kind} is not a message")
        pos = SUBJECT_AT
        (length,) = u16(payload, pos)
        subject = None if length == NONE_LEN else payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 if length == NONE_LEN else 2 + length
        (length,) = u16(payload, pos)
        if length == NONE_LEN:  # ids are never None: rejected where read
            raise ValueError("message without id")
        message_id = payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 + length
        (length,) = u16(payload, pos)
        key = None if length == NONE_LEN else payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 if length == NONE_LEN else 2 + length
        (length,) = u16(payload, pos)
        producer = None if length == NONE_LEN else payload[pos + 2 : pos + 2 + length].decode()
        pos += 2 if length == NONE_LEN else 2 + length
        (hlen,) = U32.unpack_from(payload, pos)
        pos += 4
        headers = loads(payload[pos : pos + hlen]) if hlen else {}
        pos += hlen
        tags: tuple[str, ...] = ()
        if flags & FLAG_TAGS:
            (length,) = u16(payload, pos)
            tags = tuple(payload[pos + 2 : pos + 2 + length].decode().split(","))
            pos += 2 + length
        (blen,) = U32.unpack_from(payload, pos)
        pos += 4
        if pos + blen != len(payload) or subject is None:
            raise ValueError("lengths do not add up")
    except (struct.error, ValueError) as exc:  # JSON decoders' errors are ValueErrors
        raise RecordError(str(exc)) from exc
    body = payload[pos:]
    return (
        seq, flags, created, stored, deliver, subject, message_id, key, producer, headers, body,
        tags,
    )  # fmt: skip


def records_entry(attempt: int, partition: int | None, record: bytes | memoryview) -> bytes:
    """One message of a records answer: its attempt, its partition and its record."""
    return _ENTRY.pack(attempt, -1 if partition is None else partition, len(record)) + record


def records_answer(fields: bytes, entries: Sequence[bytes]) -> bytes:
    """A records answer: ``fields`` (the answer's other fields, a JSON object) and the
    messages (``records_entry``)."""
    return b"".join(
        (_ANSWER_MAGIC, U32.pack(len(fields)), fields, U32.pack(len(entries)), *entries)
    )


def is_records_answer(content: bytes) -> bool:
    return content[: len(_ANSWER_MAGIC)] == _ANSWER_MAGIC


def read_records_answer(
    content: bytes, loads: Callable[[bytes], Any]
) -> tuple[Any, list[tuple[int, int | None, MessageFields]]]:
    """The answer's other fields and ``(attempt, partition, fields)`` per message;
    ``RecordError`` when ``content`` is not a whole records answer."""
    if not is_records_answer(content):
        raise RecordError("not a records answer")
    try:
        pos = len(_ANSWER_MAGIC)
        (length,) = U32.unpack_from(content, pos)
        pos += 4
        fields = loads(content[pos : pos + length])
        pos += length
        (count,) = U32.unpack_from(content, pos)
        pos += 4
        entry = _ENTRY.unpack_from
        messages = []
        for _ in range(count):
            attempt, partition, length = entry(content, pos)
            pos += _ENTRY.size
            record = content[pos : pos + length]
            pos += length
            message = decode_message(record, loads)
            messages.append((attempt, None if partition < 0 else partition, message))
        if pos != len(content):
            raise ValueError("lengths do not add up")
    except (struct.error, ValueError) as exc:
        raise RecordError(f"records answer: {exc}") from exc
    return fields, messages
