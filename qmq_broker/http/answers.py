"""Response models of API v1: what the broker answers, for the OpenAPI document and tests.

They mirror ``qmq_wire``'s JSON shapes field for field. The broker does not pass its answers
through them at run time (its services build the JSON directly, for speed); the contract
tests validate real answers against them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

import qmq_wire as wire
from qmq_broker.answer_fields import Count, MessageId, Name, Seq, Timestamp


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ProducedItem(_Answer):
    id: MessageId
    subject: Name
    status: Literal["stored", "duplicate", "scheduled"]
    seq: Seq | None = Field(
        description=(
            "null when scheduled (deliver_at in the future: the seq is assigned when it is "
            "due) and for a duplicate of a message still scheduled"
        )
    )
    partition: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="only for an ordered subject: the partition seq counts in"
    )


class ProduceResponse(_Answer):
    results: list[ProducedItem]


class DeliveredMessage(_Answer):
    id: MessageId
    subject: Name
    seq: Seq
    attempt: Annotated[int, Field(ge=0)]
    key: str | None
    headers: dict[str, str]
    body: str
    body_encoding: Literal["utf-8", "base64"]
    producer: str | None
    created_at: Timestamp
    stored_at: Timestamp
    partition: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="only for an ordered subject: the partition seq counts in"
    )
    tags: list[str] | None = Field(default=None, description="only for a message with tags")


class PullResponse(_Answer):
    messages: list[DeliveredMessage]
    acked: Count | None = Field(
        default=None, description='present when the pull carried "ack": as POST /v1/ack answers'
    )
    unknown: list[int] | None = Field(
        default=None, description='present when the pull carried "ack": seqs not leased to you'
    )


class AckResponse(_Answer):
    acked: Count
    unknown: list[int]


class NackResponse(_Answer):
    retrying: Count
    dead: Count


class SubjectSummary(_Answer):
    subject: Name
    messages: Count
    bytes: Count
    first_seq: Seq
    next_seq: Seq


class SubjectsResponse(_Answer):
    subjects: list[SubjectSummary]


class GroupSummary(_Answer):
    group: Name
    mode: Literal["shared", "broadcast", "ordered"]
    backlog: Count
    in_flight: Count
    retrying: Count
    dead: Count
    acked: Count
    filtered: Count = Field(description="messages its tag filter skipped: never leased or acked")
    tags: list[str] = Field(description="its tag filter (any of these); empty: no filter")


class ScheduledSummary(_Answer):
    """Delayed messages of the subject that are not due yet."""

    messages: Count
    bytes: Count
    unreadable: Count = Field(description="lost to damaged schedule files, never delivered")


class SubjectResponse(SubjectSummary):
    scheduled: ScheduledSummary
    groups: list[GroupSummary]


class DeadLetterItem(_Answer):
    seq: Seq
    attempts: Count
    error: str | None
    dead_at: Timestamp
    consumer: str | None = Field(description="the broadcast consumer; null in shared groups")
    message: DeliveredMessage | None = Field(description="null when the record is unreadable")


class DeadLettersResponse(_Answer):
    dead: list[DeadLetterItem]
    next_after_seq: Seq | None = Field(description="after_seq of the next page; null at the end")


class RedriveResponse(_Answer):
    redriven: Count


class ResetPosition(_Answer):
    partition: int | None = Field(description="an ordered subject's partition; null otherwise")
    consumer: str | None = Field(description="the broadcast consumer; null otherwise")
    seq: Seq = Field(description="the seq this state reads next")


class ResetResponse(_Answer):
    positions: list[ResetPosition]
    dropped_leases: Count = Field(description="leases dropped by force (their acks: unknown)")


class ScheduleHour(_Answer):
    hour: Timestamp
    messages: Count
    bytes: Count
    loaded: bool


class LastDispatchAnswer(_Answer):
    at: Timestamp
    lateness_ms: float


class ScheduleResponse(_Answer):
    messages: Count
    bytes: Count
    next_due_at: Timestamp | None
    dispatch_lag_ms: float
    wheel_messages: Count
    dispatched: Count
    unreadable: Count = Field(description="delayed messages lost to damaged schedule files")
    last_dispatch: LastDispatchAnswer | None
    hours: list[ScheduleHour]
    more_hours: bool


class RouteRange(_Answer):
    lo: Annotated[int, Field(ge=0, lt=wire.LOGIC_PARTITIONS)]
    hi: Annotated[int, Field(gt=0, le=wire.LOGIC_PARTITIONS)]
    partition: Annotated[int, Field(ge=0)]


class RouteVersion(_Answer):
    version: Annotated[int, Field(ge=1)]
    change: Literal["create", "split", "merge", "move"]
    ranges: list[RouteRange]
    closed: list[Annotated[int, Field(ge=0)]]


class GroupRoute(_Answer):
    group: Name
    version: Annotated[int, Field(ge=1)]


class RoutesResponse(_Answer):
    subject: Name
    ordered: Literal[True]
    logic_partitions: Literal[1024]
    on_dead: Literal["skip", "block"]
    version: Annotated[int, Field(ge=1)]
    ranges: list[RouteRange]
    history: list[RouteVersion]
    groups: list[GroupRoute]


class HealthResponse(_Answer):
    status: Literal["ok", "recovering", "stopping", "failed"] = Field(
        description='"ok" once recovery finished; the broker status with a 503'
    )


class ErrorDetail(_Answer):
    code: str
    message: str
    field: str | None


class ErrorResponse(_Answer):
    error: ErrorDetail


ANSWERS: tuple[type[BaseModel], ...] = (
    ProduceResponse,
    PullResponse,
    AckResponse,
    NackResponse,
    SubjectsResponse,
    SubjectResponse,
    DeadLettersResponse,
    RedriveResponse,
    ResetResponse,
    ScheduleResponse,
    RoutesResponse,
    HealthResponse,
    ErrorResponse,
)
"""Every answer model; the OpenAPI document lists them all."""
