"""Request models of API v1 (pydantic, strict). Field rules from ARCHITECTURE.md §2 and §3.1."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints

SUBJECT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
Subject = Annotated[str, StringConstraints(pattern=SUBJECT_PATTERN)]
GroupName = Annotated[str, StringConstraints(pattern=SUBJECT_PATTERN)]
MessageId = Annotated[str, StringConstraints(pattern=r"^[\x20-\x7e]{1,128}$")]
ConsumerId = Annotated[str, StringConstraints(pattern=r"^[\x21-\x7e]{1,200}$")]
HeaderName = Annotated[str, StringConstraints(min_length=1, max_length=256)]
HeaderValue = Annotated[str, StringConstraints(max_length=8192)]
Seq = Annotated[int, Field(ge=0, le=2**63 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Envelope(_Strict):
    id: MessageId
    subject: Subject
    key: Annotated[str, StringConstraints(max_length=200)] | None = None
    headers: Annotated[dict[HeaderName, HeaderValue], Field(max_length=64)] = Field(
        default_factory=dict
    )
    body: str
    body_encoding: Literal["utf-8", "base64"] = "utf-8"
    producer: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None
    created_at: AwareDatetime | None = None
    deliver_at: AwareDatetime | None = None


class ProduceRequest(_Strict):
    messages: Annotated[list[Envelope], Field(min_length=1, max_length=1000)]


class PullRequest(_Strict):
    subject: Subject
    group: GroupName
    consumer: ConsumerId
    max: Annotated[int, Field(ge=1, le=1000)] = 32
    wait_ms: Annotated[int, Field(ge=0, le=60000)] = 0
    mode: Literal["shared", "broadcast"] = "shared"
    start: Literal["earliest", "latest"] = "earliest"


class AckRequest(_Strict):
    subject: Subject
    group: GroupName
    consumer: ConsumerId
    seqs: Annotated[list[Seq], Field(min_length=1, max_length=10000)]


class NackRequest(AckRequest):
    delay_ms: Annotated[int, Field(ge=0, le=63_072_000_000)] | None = None
    error: Annotated[str, StringConstraints(max_length=4096)] | None = None


class RedriveRequest(_Strict):
    seqs: Annotated[list[Seq], Field(min_length=1, max_length=10000)] | None = None
    all: bool | None = None
