"""Messages at the core's edges: validated ones coming in, pulled ones going out."""

from __future__ import annotations

import base64
import functools
from datetime import timedelta

import msgspec

from qmq_broker.format.messages import MessageRecord
from qmq_wire import BodyEncoding, PulledMessageJson
from qmq_wire.records import FLAG_BODY_BASE64, MessageFields
from qmq_wire.rules import EPOCH


class IncomingMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A validated message on its way into the core; ``deliver_at_us`` 0 delivers now.

    A frozen msgspec struct, not a dataclass: one is built per produced message, and a
    struct is much cheaper to build. It holds only strings, bytes, ints and a dict of
    strings, so it cannot be part of a reference cycle (``gc=False``).
    """

    id: str
    subject: str
    key: str | None
    headers: dict[str, str]
    body: bytes
    body_base64: bool
    producer: str | None
    created_at_us: int | None
    deliver_at_us: int
    tags: tuple[str, ...] = ()


def rfc3339(micros: int) -> str:
    """Microseconds since the epoch as RFC 3339 UTC text, ``YYYY-MM-DDTHH:MM:SS.ffffffZ``.

    Exact integer arithmetic: a float would round 9999-12-31T23:59:59.999999 up into year
    10000. Raises ``OverflowError`` outside ``qmq_wire.MIN_TIME_US..MAX_TIME_US``, which
    produce never stores. A pull formats two per message, and the messages of a batch
    mostly share their seconds: those are formatted once and remembered.
    """
    seconds, fraction = divmod(micros, 1_000_000)
    return f"{_whole_second(seconds)}.{fraction:06d}Z"


@functools.lru_cache(maxsize=4096)
def _whole_second(seconds: int) -> str:
    return (EPOCH + timedelta(seconds=seconds)).isoformat(timespec="seconds")[:19]


def pulled(record: MessageRecord, *, attempt: int) -> PulledMessageJson:
    """A stored message as a pull delivers it (``docs/architecture.md`` 3.1).

    Built on a read thread, with the body already text (``body_encoding`` says how) and
    timestamps in RFC 3339, so the answer is serialised without another pass. A typed
    dict, not a dataclass: one is built per message served, and a dict is the cheapest
    record to build and to serialise.
    """
    encoding: BodyEncoding
    if record.body_base64:
        body, encoding = base64.b64encode(record.body).decode("ascii"), "base64"
    else:
        body, encoding = record.body.decode("utf-8"), "utf-8"
    message: PulledMessageJson = {
        "id": record.id,
        "subject": record.subject,
        "seq": record.seq,
        "attempt": attempt,
        "key": record.key,
        "headers": record.headers,
        "body": body,
        "body_encoding": encoding,
        "producer": record.producer,
        "created_at": rfc3339(record.created_at_us),
        "stored_at": rfc3339(record.stored_at_us),
    }
    if record.tags:
        message["tags"] = list(record.tags)
    return message


_last_stored: tuple[int, str] = (-1, "")
"""The last ``stored_at`` ``pulled_fields`` formatted: the messages of one produce share it,
and a pull serves them one after the other. One tuple, replaced whole: the read threads
share it safely."""


def pulled_fields(fields: MessageFields, *, attempt: int) -> PulledMessageJson:
    """``pulled`` of a record's fields (``qmq_broker.format.message_fields``): what a pull
    serves, with no ``MessageRecord`` in between (a third of the cost of a served message)."""
    global _last_stored
    seq, flags, created, stored, _, subject, message_id, key, producer, headers, body, tags = fields
    last = _last_stored
    if stored == last[0]:
        stored_text = last[1]
    else:
        stored_text = rfc3339(stored)
        _last_stored = (stored, stored_text)
    encoding: BodyEncoding
    if flags & FLAG_BODY_BASE64:
        text, encoding = base64.b64encode(body).decode("ascii"), "base64"
    else:
        text, encoding = body.decode(), "utf-8"
    message: PulledMessageJson = {
        "id": message_id,
        "subject": subject,
        "seq": seq,
        "attempt": attempt,
        "key": key,
        "headers": headers,
        "body": text,
        "body_encoding": encoding,
        "producer": producer,
        "created_at": rfc3339(created),
        "stored_at": stored_text,
    }
    if tags:
        message["tags"] = list(tags)
    return message
