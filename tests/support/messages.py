"""Delivered ``Message`` values for tests that hand messages to handlers or stores directly."""

from __future__ import annotations

from qmq_outbox.envelope import Message


def delivered(
    subject: str, seq: int, message_id: str, body: bytes = b"{}", attempt: int = 1
) -> Message:
    """A message as the broker delivers it, with only the fields a consumer needs."""
    return Message(
        id=message_id,
        subject=subject,
        seq=seq,
        attempt=attempt,
        key=None,
        headers={},
        body=body,
        producer=None,
        created_at=None,
        stored_at=None,
    )
