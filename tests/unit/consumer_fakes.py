"""An in-memory stand-in for the broker's pull/ack/nack (shared mode) for consumer unit tests.

It keeps the semantics the consumer relies on: a pulled message is leased to the consumer
until acked or nacked; a nack (or ``expire_leases``) makes it deliverable again with
``attempt + 1``; after ``max_attempts`` it is dead. It also records what the tests assert
on: every call, and the most leases a consumer ever held at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qmq_outbox.envelope import Message
from qmq_outbox.errors import BrokerUnavailable
from tests.support.messages import delivered
from tests.support.waiting import wait_until, wait_until_async

__all__ = ["AsyncFakeBroker", "FakeBroker", "wait_until", "wait_until_async"]


@dataclass
class _Group:
    ready: deque[int] = field(default_factory=deque)
    next_seq: int = 0
    leased: dict[int, str] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)


class FakeBroker:
    def __init__(self, *, max_attempts: int = 16) -> None:
        self.max_attempts = max_attempts
        self._cond = threading.Condition()
        self._log: dict[str, list[tuple[str, bytes]]] = {}
        self._groups: dict[tuple[str, str], _Group] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.max_leased: dict[str, int] = {}
        self.fail_pulls = 0
        self.pull_error: Exception | None = None
        self.closed = False

    # -- test controls ------------------------------------------------------------------

    def produce(self, subject: str, body: bytes = b"{}", *, message_id: str | None = None) -> int:
        with self._cond:
            log = self._log.setdefault(subject, [])
            log.append((message_id or f"{subject}-{len(log)}", body))
            self._cond.notify_all()
            return len(log) - 1

    def group(self, subject: str, group: str) -> _Group:
        with self._cond:
            return self._groups.setdefault((subject, group), _Group())

    def expire_leases(self, subject: str, group: str) -> list[int]:
        """Every current lease runs out: those messages are delivered again."""
        with self._cond:
            state = self._groups.setdefault((subject, group), _Group())
            seqs = sorted(state.leased)
            for seq in seqs:
                self._retry(state, seq)
            self._cond.notify_all()
            return seqs

    def calls_of(self, op: str) -> list[dict[str, Any]]:
        return [args for name, args in list(self.calls) if name == op]

    # -- the client's calls -------------------------------------------------------------

    def _retry(self, state: _Group, seq: int) -> str:
        state.leased.pop(seq, None)
        if state.attempts[seq] >= self.max_attempts:
            state.dead.add(seq)
            return "dead"
        state.ready.appendleft(seq)
        return "retrying"

    def _take(self, subject: str, group: str, consumer: str, limit: int) -> list[Message]:
        state = self._groups.setdefault((subject, group), _Group())
        log = self._log.get(subject, [])
        while state.next_seq < len(log):
            state.ready.append(state.next_seq)
            state.next_seq += 1
        out: list[Message] = []
        while state.ready and len(out) < limit:
            seq = state.ready.popleft()
            state.attempts[seq] = state.attempts.get(seq, 0) + 1
            state.leased[seq] = consumer
            message_id, body = log[seq]
            out.append(delivered(subject, seq, message_id, body, state.attempts[seq]))
        held = sum(1 for owner in state.leased.values() if owner == consumer)
        self.max_leased[consumer] = max(self.max_leased.get(consumer, 0), held)
        return out

    def pull(
        self,
        subject: str,
        group: str,
        consumer: str,
        *,
        max_messages: int = 32,
        wait_ms: int = 0,
        mode: str = "shared",
        start: str = "earliest",
    ) -> list[Message]:
        self.calls.append(("pull", {"subject": subject, "max": max_messages}))
        if self.pull_error is not None:
            raise self.pull_error
        if self.fail_pulls > 0:
            self.fail_pulls -= 1
            raise BrokerUnavailable("fake broker down")
        deadline = time.monotonic() + wait_ms / 1000
        with self._cond:
            while True:
                out = self._take(subject, group, consumer, max_messages)
                remaining = deadline - time.monotonic()
                if out or remaining <= 0:
                    return out
                self._cond.wait(remaining)

    def ack(self, subject: str, group: str, consumer: str, seqs: Sequence[int]) -> dict[str, Any]:
        self.calls.append(("ack", {"subject": subject, "seqs": list(seqs)}))
        with self._cond:
            state = self._groups[(subject, group)]
            unknown = [seq for seq in seqs if state.leased.get(seq) != consumer]
            for seq in seqs:
                if seq not in unknown:
                    del state.leased[seq]
                    state.acked.add(seq)
            return {"acked": len(seqs) - len(unknown), "unknown": unknown}

    def nack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        delay_ms: int | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        self.calls.append(
            ("nack", {"subject": subject, "seqs": list(seqs), "delay_ms": delay_ms, "error": error})
        )
        with self._cond:
            state = self._groups[(subject, group)]
            outcomes = [self._retry(state, seq) for seq in seqs if seq in state.leased]
            self._cond.notify_all()
            return {"retrying": outcomes.count("retrying"), "dead": outcomes.count("dead")}

    def close(self) -> None:
        self.closed = True


class AsyncFakeBroker:
    """The same broker behind ``async def`` calls (long polls poll without blocking the loop)."""

    def __init__(self, broker: FakeBroker) -> None:
        self.broker = broker

    async def pull(
        self,
        subject: str,
        group: str,
        consumer: str,
        *,
        max_messages: int = 32,
        wait_ms: int = 0,
        mode: str = "shared",
        start: str = "earliest",
    ) -> list[Message]:
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            out = self.broker.pull(subject, group, consumer, max_messages=max_messages)
            if out or time.monotonic() >= deadline:
                return out
            await asyncio.sleep(0.002)

    async def ack(
        self, subject: str, group: str, consumer: str, seqs: Sequence[int]
    ) -> dict[str, Any]:
        return self.broker.ack(subject, group, consumer, seqs)

    async def nack(
        self,
        subject: str,
        group: str,
        consumer: str,
        seqs: Sequence[int],
        *,
        delay_ms: int | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        return self.broker.nack(subject, group, consumer, seqs, delay_ms=delay_ms, error=error)

    async def aclose(self) -> None:
        self.broker.closed = True
