"""``POST /v1/messages`` in memory: checks, dedup by (subject, id), store now or when due.

All or nothing, as on the broker: every envelope is checked (rules, body size, delay,
an ordered subject's key) before any is stored.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import qmq_wire as wire
from qmq_outbox.testing.delayed import DelayedMessage
from qmq_outbox.testing.logs import log_name
from qmq_outbox.testing.state import BrokerState
from qmq_wire import rules
from qmq_wire.ordered import logic_partition
from qmq_wire.rules import Refused, micros, parse_timestamp


class Produce:
    def __init__(self, state: BrokerState, forbidden_subjects: set[str]) -> None:
        self.state = state
        self.forbidden_subjects = forbidden_subjects
        self.stored: list[dict[str, Any]] = []
        """Every accepted envelope, as sent."""

    def produce(self, doc: Any) -> dict[str, Any]:
        envelopes: list[dict[str, Any]] = rules.PRODUCE.check(doc)["messages"]
        for index, envelope in enumerate(envelopes):
            if envelope["subject"] in self.forbidden_subjects:
                field = f"messages[{index}].subject"
                message = f"may not produce to {envelope['subject']!r}"
                raise Refused("forbidden", message, field)
        now = self.state.now_us()
        accepted = []
        for index, envelope in enumerate(envelopes):
            body = decode_body(envelope, f"messages[{index}].body", self.state.max_body)
            due = self._due_us(envelope, now, index)
            accepted.append((envelope, body, due, self._partition_of(envelope, index, due)))
        results = [
            self._accept(envelope, body, due, now, partition)
            for envelope, body, due, partition in accepted
        ]
        self.state.wake()
        return {"results": results}

    def _partition_of(self, envelope: dict[str, Any], index: int, due: int) -> int | None:
        """The partition a message of an ordered subject goes to (None for a plain one)."""
        routes = self.state.ordered.get(envelope["subject"])
        if routes is None:
            return None
        if due:
            message = f"{routes.subject!r} is ordered: its messages cannot be delayed"
            raise Refused("delay_not_ordered", message, f"messages[{index}].deliver_at")
        key = envelope.get("key")
        if key is None:
            message = f"{routes.subject!r} is ordered: every message needs a key"
            raise Refused("key_required", message, f"messages[{index}].key")
        return routes.current.partition_of(logic_partition(key))

    def _due_us(self, envelope: dict[str, Any], now: int, index: int) -> int:
        """A future due time, or 0 (deliver now); 400 beyond the longest delay."""
        deliver_at = parse_timestamp(envelope.get("deliver_at"))
        due = micros(deliver_at) if deliver_at is not None else 0
        if due <= now:
            return 0
        if due - now > self.state.max_delay_us:
            field = f"messages[{index}].deliver_at"
            raise Refused("delay_too_long", "deliver_at is too far ahead", field)
        return due

    def _accept(
        self, envelope: dict[str, Any], body: bytes, due: int, now: int, partition: int | None
    ) -> wire.ProduceResultJson:
        subject, message_id = envelope["subject"], envelope["id"]
        routes = self.state.ordered.get(subject)
        # An ordered subject's resend may sit in any partition that held its key.
        held = [partition] if routes is None else routes.holders(logic_partition(envelope["key"]))
        for where in held:
            log = self.state.logs.get(log_name(subject, where))
            if log is not None and message_id in log.dedup:
                return _result(envelope, "duplicate", log.dedup[message_id], where)
        if (subject, message_id) in self.state.delayed:
            return _result(envelope, "duplicate", None, None)
        self.stored.append(envelope)
        if due:
            self.state.delayed.add(DelayedMessage(envelope, body, now), due)
            return _result(envelope, "scheduled", None, None)
        log = self.state.log(log_name(subject, partition))
        seq = log.append(envelope, body, created_default_us=now, now_us=now, partition=partition)
        return _result(envelope, "stored", seq, partition)


def decode_body(envelope: Mapping[str, Any], field: str, max_body: int) -> bytes:
    """The body's bytes; 400 for bad base64, 413 over ``max_body``."""
    if envelope.get("body_encoding", "utf-8") == "base64":
        try:
            body = base64.b64decode(envelope["body"], validate=True)
        except (binascii.Error, ValueError):
            raise Refused("invalid_body", "body is not valid base64", field) from None
    else:
        body = str(envelope["body"]).encode("utf-8")
    if len(body) > max_body:
        message = f"body is {len(body)} bytes; the limit is {max_body}"
        raise Refused("body_too_large", message, field)
    return body


def _result(
    envelope: dict[str, Any], status: wire.ProduceStatus, seq: int | None, partition: int | None
) -> wire.ProduceResultJson:
    result: wire.ProduceResultJson = {
        "id": envelope["id"],
        "subject": envelope["subject"],
        "status": status,
        "seq": seq,
    }
    if partition is not None:
        result["partition"] = partition
    return result
