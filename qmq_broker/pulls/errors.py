"""Answers the pull scheduler gives instead of messages."""

from __future__ import annotations

from qmq_broker.errors import Overloaded, Unavailable


class MailboxFull(Overloaded):
    """The group already has as many pulls pending as its mailbox holds; retry later."""

    def __init__(self, *, subject: str, group: str, size: int, retry_after_s: int = 1) -> None:
        super().__init__(
            code="mailbox_full",
            message=f"group {group!r} on {subject!r} has {size} pulls pending; retry later",
            field="group",
            retry_after_s=retry_after_s,
        )


class TooManyPulls(Overloaded):
    """The broker already has as many pulls pending, all groups together, as it takes."""

    def __init__(self, *, limit: int, retry_after_s: int = 1) -> None:
        super().__init__(
            code="too_many_pulls",
            message=f"the broker has {limit} pulls pending (--max-pending-pulls); retry later",
            retry_after_s=retry_after_s,
        )


class DeadlineExceeded(Unavailable):
    """The pull waited for a worker past its deadline; answered, never dropped."""

    def __init__(self, *, subject: str, group: str, waited_s: float) -> None:
        super().__init__(
            code="deadline_exceeded",
            message=(
                f"pull for group {group!r} on {subject!r} waited {waited_s:.3f}s for a worker "
                "past its deadline; the broker is overloaded, retry later"
            ),
        )


class ShuttingDown(Unavailable):
    """The broker stopped before this pull could be served."""

    def __init__(self) -> None:
        super().__init__(code="shutting_down", message="the broker is shutting down")
