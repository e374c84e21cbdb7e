"""The JSON documents of API v1 as ``TypedDict`` s: what travels, not how it is checked.

``docs/architecture.md`` section 3.1 is their prose. The broker's pydantic answer models
(``qmq_broker.http.answers``) mirror these field for field, and a unit test keeps them in step.
Timestamps are RFC 3339 strings in UTC.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

ProduceStatus = Literal["stored", "duplicate", "scheduled"]
BodyEncoding = Literal["utf-8", "base64"]
PullMode = Literal["shared", "broadcast", "ordered"]
OnDead = Literal["skip", "block"]
RouteChange = Literal["create", "split", "merge", "move"]
StartPosition = Literal["earliest", "latest"]


class SeqPositionJson(TypedDict):
    """The message with this seq (of one partition, on an ordered subject)."""

    seq: int


class TimePositionJson(TypedDict):
    """The first message stored at or after this RFC 3339 time."""

    time: str


PositionJson = StartPosition | SeqPositionJson | TimePositionJson
"""Where a group reads from: a pull's ``start`` and a reset's ``to``."""


class EnvelopeJson(TypedDict):
    """One message of ``POST /v1/messages``; optional fields may be left out."""

    id: str
    subject: str
    body: str
    body_encoding: NotRequired[BodyEncoding]
    key: NotRequired[str | None]
    headers: NotRequired[dict[str, str]]
    producer: NotRequired[str | None]
    created_at: NotRequired[str | None]
    deliver_at: NotRequired[str | None]
    tags: NotRequired[list[str]]


class _ProduceResult(TypedDict):
    id: str
    subject: str
    status: ProduceStatus
    seq: int | None


class ProduceResultJson(_ProduceResult, total=False):
    """``seq`` is null for a scheduled message and for a duplicate of one; ``partition``
    only for an ordered subject (seqs count per partition there)."""

    partition: int


class ProduceAnswerJson(TypedDict):
    results: list[ProduceResultJson]


class _PulledMessage(TypedDict):
    id: str
    subject: str
    seq: int
    attempt: int
    key: str | None
    headers: dict[str, str]
    body: str
    body_encoding: BodyEncoding
    producer: str | None
    created_at: str
    stored_at: str


class PulledMessageJson(_PulledMessage, total=False):
    """``partition`` only for an ordered subject; ``tags`` only for a message that has some."""

    partition: int
    tags: list[str]


class _PullAnswerMessages(TypedDict):
    messages: list[PulledMessageJson]


class PullAnswerJson(_PullAnswerMessages, total=False):
    # With "ack" in the pull (and only then): as AckAnswerJson answers. Optional keys are
    # spelled with total=False: under postponed annotations, 3.11 does not see NotRequired.
    acked: int
    unknown: list[int]


class AckAnswerJson(TypedDict):
    acked: int
    unknown: list[int]


class NackAnswerJson(TypedDict):
    retrying: int
    dead: int


class SubjectStatsJson(TypedDict):
    """``next_seq`` is the next seq visible to pulls (durable messages end there)."""

    subject: str
    messages: int
    bytes: int
    first_seq: int
    next_seq: int


class SubjectsAnswerJson(TypedDict):
    subjects: list[SubjectStatsJson]


class GroupStatsJson(TypedDict):
    group: str
    mode: PullMode
    backlog: int
    in_flight: int
    retrying: int
    dead: int
    acked: int
    filtered: int  # messages its tag filter skipped (never leased, never acked)
    tags: list[str]  # its tag filter; empty: every message


class ScheduledStatsJson(TypedDict):
    """Delayed messages of a subject that are not due yet; ``unreadable``: lost to damaged
    schedule files (docs/delayed-messages.md)."""

    messages: int
    bytes: int
    unreadable: int


class SubjectAnswerJson(SubjectStatsJson):
    scheduled: ScheduledStatsJson
    groups: list[GroupStatsJson]


class DeadLetterJson(TypedDict):
    """``consumer`` is set in broadcast groups; ``message`` is null when unreadable."""

    seq: int
    attempts: int
    error: str | None
    dead_at: str
    consumer: str | None
    message: PulledMessageJson | None


class DeadLettersAnswerJson(TypedDict):
    dead: list[DeadLetterJson]
    next_after_seq: int | None


class RedriveAnswerJson(TypedDict):
    redriven: int


class ResetPositionJson(TypedDict):
    """Where one delivery state of the group reads next after a reset."""

    partition: int | None  # an ordered subject's partition; null on a plain subject
    consumer: str | None  # the broadcast consumer; null in shared and ordered groups
    seq: int


class ResetAnswerJson(TypedDict):
    """``POST .../groups/{group}/reset``: every state moved, and the leases dropped."""

    positions: list[ResetPositionJson]
    dropped_leases: int


class RouteRangeJson(TypedDict):
    """Logic partitions ``[lo, hi)`` stored in physical partition ``partition``."""

    lo: int
    hi: int
    partition: int


class RouteVersionJson(TypedDict):
    version: int
    change: RouteChange
    ranges: list[RouteRangeJson]
    closed: list[int]  # the partitions this change closed


class GroupRouteJson(TypedDict):
    group: str
    version: int  # the route version whose partitions the group consumes


class RoutesAnswerJson(TypedDict):
    """An ordered subject's routes (``GET /v1/subjects/{subject}/routes`` and the answer
    of a declaration or a change)."""

    subject: str
    ordered: bool
    logic_partitions: int
    on_dead: OnDead
    version: int
    ranges: list[RouteRangeJson]
    history: list[RouteVersionJson]
    groups: list[GroupRouteJson]


class HealthAnswerJson(TypedDict):
    """``ok`` once recovery finished; otherwise the broker's status, with a 503."""

    status: str


class ErrorDetailJson(TypedDict):
    code: str
    message: str
    field: str | None


class ErrorAnswerJson(TypedDict):
    """Every error answer, whatever its status."""

    error: ErrorDetailJson
