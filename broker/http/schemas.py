"""Request models of API v1 (pydantic, strict); the rules themselves come from ``qmq_wire``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints

import qmq_wire as wire

Subject = Annotated[str, StringConstraints(pattern=wire.NAME_PATTERN)]
GroupName = Annotated[str, StringConstraints(pattern=wire.NAME_PATTERN)]
MessageId = Annotated[str, StringConstraints(pattern=wire.MESSAGE_ID_PATTERN)]
ConsumerId = Annotated[str, StringConstraints(pattern=wire.CONSUMER_ID_PATTERN)]
HeaderName = Annotated[str, StringConstraints(min_length=1, max_length=wire.MAX_HEADER_NAME)]
HeaderValue = Annotated[str, StringConstraints(max_length=wire.MAX_HEADER_VALUE)]
Seq = Annotated[int, Field(ge=0, le=wire.MAX_SEQ)]
Seqs = Annotated[list[Seq], Field(min_length=1, max_length=wire.MAX_SEQS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Envelope(_Strict):
    id: MessageId
    subject: Subject
    key: Annotated[str, StringConstraints(max_length=wire.MAX_KEY)] | None = None
    headers: Annotated[dict[HeaderName, HeaderValue], Field(max_length=wire.MAX_HEADERS)] = Field(
        default_factory=dict
    )
    body: str
    body_encoding: Literal["utf-8", "base64"] = "utf-8"
    producer: (
        Annotated[str, StringConstraints(min_length=1, max_length=wire.MAX_PRODUCER)] | None
    ) = None
    created_at: AwareDatetime | None = None
    deliver_at: AwareDatetime | None = None


class ProduceRequest(_Strict):
    messages: Annotated[list[Envelope], Field(min_length=1, max_length=wire.MAX_PRODUCE_BATCH)]


class PullRequest(_Strict):
    subject: Subject
    group: GroupName
    consumer: ConsumerId
    max: Annotated[int, Field(ge=1, le=wire.MAX_PULL)] = wire.DEFAULT_PULL
    wait_ms: Annotated[int, Field(ge=0, le=wire.MAX_WAIT_MS)] = 0
    mode: Literal["shared", "broadcast"] = "shared"
    start: Literal["earliest", "latest"] = "earliest"


class AckRequest(_Strict):
    subject: Subject
    group: GroupName
    consumer: ConsumerId
    seqs: Seqs


class NackRequest(AckRequest):
    delay_ms: Annotated[int, Field(ge=0, le=wire.MAX_NACK_DELAY_MS)] | None = None
    error: Annotated[str, StringConstraints(max_length=wire.MAX_ERROR_TEXT)] | None = None


class RedriveRequest(_Strict):
    seqs: Seqs | None = None
    all: bool | None = None


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    Envelope,
    ProduceRequest,
    PullRequest,
    AckRequest,
    NackRequest,
    RedriveRequest,
)
"""Every request model (error codes name their fields; the OpenAPI document lists them)."""
