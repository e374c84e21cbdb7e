"""A produce request's envelopes as the core's messages: the checks the wire leaves to the
broker (base64, body size, due time, created_at range), in envelope order."""

from __future__ import annotations

import base64
import binascii

import qmq_wire
from qmq_broker.errors import Invalid
from qmq_broker.http import bodies
from qmq_broker.messages import IncomingMessage


def incoming_messages(
    envelopes: list[bodies.Envelope], *, now_us: int, max_body_bytes: int, max_delay_s: float
) -> list[IncomingMessage]:
    """The core's messages, or ``Invalid`` naming the first envelope field that fails."""
    low, high = qmq_wire.MIN_TIME_US, qmq_wire.MAX_TIME_US
    messages: list[IncomingMessage] = []
    for index, envelope in enumerate(envelopes):
        base64_body = envelope.body_encoding == "base64"
        body = _base64(envelope.body, index) if base64_body else envelope.body.encode()
        if len(body) > max_body_bytes:
            raise Invalid(
                code="body_too_large",
                message=f"body is {len(body)} bytes; the limit is {max_body_bytes}",
                field=f"messages[{index}].body",
            )
        deliver_at = envelope.deliver_at
        deliver_at_us = 0 if deliver_at is None else _due(deliver_at, now_us, index, max_delay_s)
        created_at_us = envelope.created_at
        if created_at_us is not None and not low <= created_at_us <= high:
            raise _out_of_range(index, "created_at")
        messages.append(
            IncomingMessage(
                id=envelope.id,
                subject=envelope.subject,
                key=envelope.key,
                headers=envelope.headers,
                body=body,
                body_base64=base64_body,
                producer=envelope.producer,
                created_at_us=created_at_us,
                deliver_at_us=deliver_at_us,
                tags=tuple(envelope.tags),
            )
        )
    return messages


def _due(due_us: int, now_us: int, index: int, limit_s: float) -> int:
    """A future due time in microseconds, or 0 (deliver now) for one in the past."""
    if not qmq_wire.MIN_TIME_US <= due_us <= qmq_wire.MAX_TIME_US:
        raise _out_of_range(index, "deliver_at")
    if due_us <= now_us:
        return 0
    if due_us - now_us > limit_s * 1_000_000:
        raise Invalid(
            code="delay_too_long",
            message=f"deliver_at is more than {_span(limit_s)} ahead (--max-delay)",
            field=f"messages[{index}].deliver_at",
        )
    return due_us


def _out_of_range(index: int, name: str) -> Invalid:
    """A timestamp the wire admits but no answer could carry (outside the range in UTC)."""
    return Invalid(
        code=f"invalid_{name}",
        message=f"{name} must lie between {qmq_wire.MIN_TIME} and {qmq_wire.MAX_TIME} in UTC",
        field=f"messages[{index}].{name}",
    )


def _span(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:g} days" if days >= 1 else f"{seconds:g} s"


def _base64(text: str, index: int) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise Invalid(
            code="invalid_body",
            message="body is not valid base64",
            field=f"messages[{index}].body",
        ) from None
