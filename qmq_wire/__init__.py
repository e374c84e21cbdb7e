"""The wire contract of API v1, shared by the SDK, the broker and the test fake.

Name rules, size limits and error codes live here once; ``docs/architecture.md`` (sections 2
and 3.1) is their prose. This module is pure: no I/O and no third-party imports, so the SDK,
the broker's request schemas and ``qmq_outbox.testing`` can all depend on it.
"""

from __future__ import annotations

import re
from typing import Final

from qmq_wire.ordered import LOGIC_PARTITIONS, MAX_PARTITIONS
from qmq_wire.shapes import (
    AckAnswerJson,
    BodyEncoding,
    DeadLetterJson,
    DeadLettersAnswerJson,
    EnvelopeJson,
    ErrorAnswerJson,
    ErrorDetailJson,
    GroupRouteJson,
    GroupStatsJson,
    HealthAnswerJson,
    NackAnswerJson,
    OnDead,
    PositionJson,
    ProduceAnswerJson,
    ProduceResultJson,
    ProduceStatus,
    PullAnswerJson,
    PulledMessageJson,
    PullMode,
    RedriveAnswerJson,
    ResetAnswerJson,
    ResetPositionJson,
    RouteChange,
    RouteRangeJson,
    RoutesAnswerJson,
    RouteVersionJson,
    ScheduledStatsJson,
    SeqPositionJson,
    StartPosition,
    SubjectAnswerJson,
    SubjectsAnswerJson,
    SubjectStatsJson,
    TimePositionJson,
)

__all__ = [
    "LOGIC_PARTITIONS",
    "MAX_PARTITIONS",
    "AckAnswerJson",
    "BodyEncoding",
    "DeadLetterJson",
    "DeadLettersAnswerJson",
    "EnvelopeJson",
    "ErrorAnswerJson",
    "ErrorDetailJson",
    "GroupRouteJson",
    "GroupStatsJson",
    "HealthAnswerJson",
    "NackAnswerJson",
    "OnDead",
    "PositionJson",
    "ProduceAnswerJson",
    "ProduceResultJson",
    "ProduceStatus",
    "PullAnswerJson",
    "PullMode",
    "PulledMessageJson",
    "RedriveAnswerJson",
    "ResetAnswerJson",
    "ResetPositionJson",
    "RouteChange",
    "RouteRangeJson",
    "RouteVersionJson",
    "RoutesAnswerJson",
    "ScheduledStatsJson",
    "SeqPositionJson",
    "StartPosition",
    "SubjectAnswerJson",
    "SubjectStatsJson",
    "SubjectsAnswerJson",
    "TimePositionJson",
]

# --- names ---------------------------------------------------------------------------------

NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
"""Subjects and group names: a letter or digit, then up to 199 of ``A-Za-z0-9._-``."""
NAME_RE: Final = re.compile(NAME_PATTERN)
RESERVED_PREFIX: Final = "_qmq"
"""Subject names starting with this are reserved for the broker."""
MESSAGE_ID_PATTERN: Final = r"^[\x20-\x7e]{1,128}$"
CONSUMER_ID_PATTERN: Final = r"^[\x21-\x7e]{1,200}$"


def valid_name(value: str) -> bool:
    """Whether ``value`` is a valid subject or group name (``$`` must not admit a newline)."""
    return NAME_RE.fullmatch(value) is not None


# --- limits --------------------------------------------------------------------------------

MAX_MESSAGE_ID: Final = 128
MAX_KEY: Final = 200
MAX_HEADERS: Final = 64
MAX_HEADER_NAME: Final = 256
MAX_HEADER_VALUE: Final = 8192
MAX_PRODUCER: Final = 200
MAX_TAGS: Final = 8
"""Tags of one message, and of one group's filter: a handful, like a queue's tags."""
MAX_TAG: Final = 64
TAG_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,64}$"
"""A tag: 1 to ``MAX_TAG`` of ``A-Za-z0-9._:-`` (safe as a JetStream subject token, a
RabbitMQ routing-key word and a header value; no comma, so a list joins with one)."""
MAX_BODY_BYTES: Final = 1024 * 1024
"""The broker's default body limit (``--max-body``)."""
MAX_PRODUCE_BATCH: Final = 1000
MAX_PULL: Final = 1000
DEFAULT_PULL: Final = 32
MAX_KEYS_IN_FLIGHT: Final = 1024
DEFAULT_KEYS_IN_FLIGHT: Final = 16
"""An ordered pull's ``max_keys``: keys with a message in flight per partition at once."""
MAX_WAIT_MS: Final = 60_000
MAX_SEQS: Final = 10_000
MAX_NACK_DELAY_MS: Final = 63_072_000_000
MAX_ERROR_TEXT: Final = 4096
MAX_SEQ: Final = 2**63 - 1
MIN_TIME: Final = "0001-01-01T00:00:00Z"
MAX_TIME: Final = "9999-12-31T23:59:59.999999Z"
"""Timestamps (``created_at``, ``deliver_at``) lie in this range once normalised to UTC."""
MIN_TIME_US: Final = -62_135_596_800_000_000
"""``MIN_TIME`` in microseconds since the Unix epoch."""
MAX_TIME_US: Final = 253_402_300_799_999_999
"""``MAX_TIME`` in microseconds since the Unix epoch."""
MAX_PARTITION_NUMBER: Final = 2**31 - 1
"""Largest partition number a request may name (numbers grow with route changes)."""
DEFAULT_DEAD_PAGE: Final = 100
MAX_DEAD_PAGE: Final = 1000

# --- delivery defaults (docs/architecture.md section 3.2) ----------------------------------

DEFAULT_ACK_TIMEOUT_S: Final = 30.0
DEFAULT_MAX_ATTEMPTS: Final = 16
DEFAULT_BACKOFF_S: Final = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
"""Seconds before retry number n (1-based) when a nack names no delay; the last repeats."""
DEFAULT_MAX_DELAY_S: Final = 730 * 86400
"""How far ahead ``deliver_at`` may be (``--max-delay``, 2 years)."""

# --- enumerations --------------------------------------------------------------------------

BODY_ENCODINGS: Final = ("utf-8", "base64")
PULL_MODES: Final = ("shared", "broadcast", "ordered")
START_POSITIONS: Final = ("earliest", "latest")
PRODUCE_STATUSES: Final = ("stored", "duplicate", "scheduled")

# --- error codes ---------------------------------------------------------------------------
# Every error answer is ``{"error": {"code", "message", "field"}}``; the status follows from
# the code. Codes named ``invalid_<field>``, ``missing_field`` and ``unknown_field`` come from
# request validation and are all 400.

ERROR_STATUS: Final[dict[str, int]] = {
    # 400: the request is invalid
    "invalid_json": 400,
    "invalid_body": 400,
    "invalid_request": 400,
    "missing_field": 400,
    "unknown_field": 400,
    "delay_too_long": 400,
    "invalid_redrive": 400,
    # 401/403: auth, and requests a browser could send on a hostile page's behalf
    "unauthorized": 401,
    "forbidden": 403,
    "host_not_allowed": 403,
    "origin_not_allowed": 403,
    # 404: unknown route, subject, group or broadcast consumer
    "not_found": 404,
    "subject_not_found": 404,
    "group_not_found": 404,
    "consumer_not_found": 404,
    "partition_not_found": 404,
    "method_not_allowed": 405,
    # 409: the request contradicts existing state
    "mode_conflict": 409,
    "tags_conflict": 409,  # a pull's tag filter is not the one its group fixed
    "subject_conflict": 409,
    "not_ordered": 409,
    "route_conflict": 409,
    "group_busy": 409,  # a reset while the group has messages leased out (without force)
    # 409 too: requests valid on their own that an ordered subject (or a plain one) refuses
    "key_required": 409,
    "delay_not_ordered": 409,
    "partition_required": 409,
    "tags_not_ordered": 409,  # a tag filter on an ordered subject's pull
    # 413: too large
    "request_too_large": 413,
    "body_too_large": 413,
    # 415: a POST whose Content-Type is not application/json
    "unsupported_media_type": 415,
    # 429: a group's mailbox, or the broker's pull cap, is full (``Retry-After``)
    "mailbox_full": 429,
    "too_many_pulls": 429,
    # 503: not now (recovering, shutting down, read-only, overloaded)
    "recovering": 503,
    "shutting_down": 503,
    "read_only": 503,
    "subject_fenced": 503,  # an ordered subject whose route table could not be rebuilt
    "storage_failed": 503,
    "deadline_exceeded": 503,
    "too_many_connections": 503,
    # 500: a bug; the broker log has the traceback
    "internal": 500,
}


def error_status(code: str) -> int:
    """The HTTP status of an error code (``invalid_*`` codes are 400)."""
    status = ERROR_STATUS.get(code)
    if status is None:
        return 400 if code.startswith("invalid_") else 500
    return status


def error_answer(code: str, message: str, field: str | None = None) -> ErrorAnswerJson:
    """The body of an error answer."""
    return {"error": {"code": code, "message": message, "field": field}}


def transient(status: int) -> bool:
    """Whether a request that got ``status`` may succeed later (429 and 5xx)."""
    return status == 429 or status >= 500
