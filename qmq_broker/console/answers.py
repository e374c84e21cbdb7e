"""Answer models of the console's JSON views, for the OpenAPI document and tests (the
service builds the JSON directly, as the rest of API v1 does; ``qmq_broker.http.answers``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from qmq_broker.answer_fields import Count, Name, Timestamp

Seconds = Annotated[float, Field(ge=0)]
Rate = Annotated[float, Field(ge=0)] | None


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ConsoleDisk(_Answer):
    data_bytes: Count = Field(description="allocated to the data directory's files")
    free_bytes: Count
    total_bytes: Count


class ConsoleFsync(_Answer):
    fsyncs: Count = Field(description="group-commit fsyncs in the last sample interval")
    mean_ms: Seconds | None
    p99_ms: Seconds | None = Field(
        description="upper bound of the histogram bucket holding the 99th percentile"
    )


class ConsoleSubjectSummary(_Answer):
    subject: Name
    ordered: bool
    messages: Count
    bytes: Count
    groups: Count = Field(description="groups the token sees")
    backlog: Count
    in_flight: Count
    retrying: Count
    dead: Count
    in_per_s: Rate = Field(description="stored per second over the last sample interval")
    out_per_s: Rate = Field(description="acked per second by the groups shown, over the same")
    oldest_unacked_age_s: Seconds | None = Field(
        description="age of the oldest message a group has not acked (dead letters aside)"
    )


class ConsoleOverview(_Answer):
    status: Literal["ready", "failed"] = Field(
        description='"failed": storage failed and the broker is read-only'
    )
    at: Timestamp
    sample_interval_s: Seconds
    sampled_at: Timestamp | None
    in_per_s: Rate
    out_per_s: Rate
    backlog: Count
    dead: Count
    oldest_unacked_age_s: Seconds | None
    disk: ConsoleDisk | None
    fsync: ConsoleFsync
    subjects: list[ConsoleSubjectSummary]


class ConsoleConsumer(_Answer):
    consumer: str
    seen_s_ago: Seconds


class ConsoleGroup(_Answer):
    group: Name
    oldest_unacked_age_s: Seconds | None
    consumers: list[ConsoleConsumer] = Field(description="heard from in the last 60 s")


class ConsoleBacklogSeries(_Answer):
    group: Name
    values: list[Count | None]


class ConsoleHistory(_Answer):
    at: list[Timestamp]
    in_per_s: list[Rate]
    out_per_s: list[Rate]
    backlog: list[ConsoleBacklogSeries]


class ConsolePartitionOwner(_Answer):
    group: Name
    partition: Annotated[int, Field(ge=0)]
    consumer: str
    lease_left_s: Seconds


class ConsoleSubject(_Answer):
    subject: Name
    ordered: bool
    sample_interval_s: Seconds
    groups: list[ConsoleGroup]
    history: ConsoleHistory
    partitions: list[ConsolePartitionOwner]


ANSWERS: tuple[type[BaseModel], ...] = (ConsoleOverview, ConsoleSubject)
