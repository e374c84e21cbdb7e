"""Checks of envelope fields, applied by ``publish()`` before the insert.

The rules are ``qmq_wire``'s (``docs/architecture.md`` section 2), so a message that passes
here is not rejected by the broker for its subject, id, key or headers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from qmq_outbox.errors import InvalidMessage
from qmq_wire import (
    MAX_HEADERS,
    MAX_KEY,
    MAX_MESSAGE_ID,
    MAX_TAG,
    NAME_PATTERN,
    RESERVED_PREFIX,
    valid_name,
)
from qmq_wire.rules import TAGS, Refused


def check_subject(subject: str) -> str:
    if not valid_name(subject) or subject.startswith(RESERVED_PREFIX):
        raise InvalidMessage(
            f"invalid subject {subject!r}: must match {NAME_PATTERN} "
            f"and not start with {RESERVED_PREFIX!r}"
        )
    return subject


def check_message_id(message_id: str) -> str:
    if not 0 < len(message_id) <= MAX_MESSAGE_ID or not all(" " < c <= "~" for c in message_id):
        raise InvalidMessage(
            f"invalid message id {message_id!r}: 1..{MAX_MESSAGE_ID} printable ASCII characters"
        )
    return message_id


def check_key(key: str | None) -> str | None:
    if key is not None and len(key) > MAX_KEY:
        raise InvalidMessage(f"key longer than {MAX_KEY} characters")
    return key


def check_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    if not headers:
        return {}
    if len(headers) > MAX_HEADERS:
        raise InvalidMessage(f"{len(headers)} headers, at most {MAX_HEADERS} allowed")
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidMessage(f"header {name!r}: names and values must be strings")
    return dict(headers)


def resolve_deliver_at(
    now: datetime, delay: timedelta | None, deliver_at: datetime | None
) -> datetime | None:
    """``deliver_at`` from either argument (not both); aware datetimes only; None = now."""
    if delay is not None and deliver_at is not None:
        raise InvalidMessage("pass delay= or deliver_at=, not both")
    if delay is not None:
        if delay < timedelta(0):
            raise InvalidMessage(f"negative delay {delay}")
        return now + delay if delay else None
    if deliver_at is not None and deliver_at.tzinfo is None:
        raise InvalidMessage("deliver_at must be timezone-aware (e.g. datetime.now(UTC))")
    return deliver_at


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """Tags by ``qmq_wire.rules.TAGS``: at most ``MAX_TAGS`` distinct ``TAG_PATTERN`` tags."""
    if tags is None:
        return ()
    if isinstance(tags, str):
        raise InvalidMessage(f"tags must be a list of strings, not the string {tags!r}")
    listed = list(tags)
    try:
        accepted = TAGS.accepts(listed, "tags", "tags")
    except Refused as exc:
        accepted = False
        detail = exc.message
    else:
        detail = "tags: invalid value"
    if not accepted:
        raise InvalidMessage(
            f"invalid tags {listed!r} ({detail}): at most {TAGS.high} distinct tags of "
            f"1..{MAX_TAG} characters from A-Za-z0-9._:-"
        )
    return tuple(listed)
