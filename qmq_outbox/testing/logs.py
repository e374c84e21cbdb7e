"""Stored messages in memory: one append-only log per plain subject or ordered partition.

A log's index is its seq; its dedup table never forgets an id. Times are microseconds since
the Unix epoch; answers render them as RFC 3339 in UTC, as the broker does.
"""

from __future__ import annotations

import base64
import dataclasses
from datetime import timedelta
from typing import Any

import qmq_wire as wire
from qmq_wire.ordered import partition_log
from qmq_wire.rules import EPOCH, Position, micros, parse_timestamp


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StoredMessage:
    """A message as stored, rendered for a pull by ``to_json``."""

    seq: int
    id: str
    subject: str
    key: str | None
    headers: dict[str, str]
    body: bytes
    base64: bool
    producer: str | None
    created_at_us: int
    stored_at_us: int
    partition: int | None = None  # of an ordered subject
    tags: tuple[str, ...] = ()

    def to_json(self, attempt: int) -> wire.PulledMessageJson:
        answer: wire.PulledMessageJson = {
            "id": self.id,
            "subject": self.subject,
            "seq": self.seq,
            "attempt": attempt,
            "key": self.key,
            "headers": self.headers,
            "body": (
                base64.b64encode(self.body).decode("ascii")
                if self.base64
                else self.body.decode("utf-8")
            ),
            "body_encoding": "base64" if self.base64 else "utf-8",
            "producer": self.producer,
            "created_at": rfc3339(self.created_at_us),
            "stored_at": rfc3339(self.stored_at_us),
        }
        if self.partition is not None:
            answer["partition"] = self.partition
        if self.tags:
            answer["tags"] = list(self.tags)
        return answer


@dataclasses.dataclass(slots=True)
class SubjectLog:
    """The messages of a plain subject or an ordered subject's partition, and their ids."""

    name: str
    messages: list[StoredMessage] = dataclasses.field(default_factory=list)
    dedup: dict[str, int] = dataclasses.field(default_factory=dict)
    total_bytes: int = 0

    @property
    def end(self) -> int:
        """The next seq (every stored message is visible at once)."""
        return len(self.messages)

    def seq_at(self, position: Position) -> int:
        """The seq a group at ``position`` reads next (as ``qmq_broker``'s ``SubjectLog``;
        nothing is ever removed here, so the first seq is 0)."""
        if position.kind == "latest":
            return self.end
        if position.kind == "seq":
            return min(position.value, self.end)
        if position.kind == "time":
            return next(
                (m.seq for m in self.messages if m.stored_at_us >= position.value), self.end
            )
        return 0

    def key_of(self, seq: int) -> str | None:
        return self.messages[seq].key

    def append(
        self,
        envelope: dict[str, Any],
        body: bytes,
        *,
        created_default_us: int,
        now_us: int,
        partition: int | None,
    ) -> int:
        """Store a checked envelope; its seq."""
        created = parse_timestamp(envelope.get("created_at"))
        stored = StoredMessage(
            seq=self.end,
            id=envelope["id"],
            subject=envelope["subject"],
            key=envelope.get("key"),
            headers=dict(envelope.get("headers") or {}),
            body=body,
            base64=envelope.get("body_encoding") == "base64",
            producer=envelope.get("producer"),
            created_at_us=micros(created) if created is not None else created_default_us,
            stored_at_us=now_us,
            partition=partition,
            tags=tuple(envelope.get("tags") or ()),
        )
        self.messages.append(stored)
        self.dedup[stored.id] = stored.seq
        self.total_bytes += len(body)
        return stored.seq

    def stats(self) -> wire.SubjectStatsJson:
        return {
            "subject": self.name,
            "messages": self.end,
            "bytes": self.total_bytes,
            "first_seq": 0,
            "next_seq": self.end,
        }


def log_name(subject: str, partition: int | None) -> str:
    """The log a message of ``subject`` is kept in: its own, or its partition's."""
    return subject if partition is None else partition_log(subject, partition)


def rfc3339(micros_: int) -> str:
    moment = EPOCH + timedelta(microseconds=micros_)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
