"""Answers the scheduler gives instead of messages; each is an HTTP error for the client."""

from __future__ import annotations

from broker.errors import RequestError


class MailboxFull(RequestError):
    """The group already has as many pulls pending as its mailbox holds; retry later (429)."""

    def __init__(self, *, subject: str, group: str, size: int, retry_after_s: int = 1) -> None:
        super().__init__(
            status=429,
            code="mailbox_full",
            message=f"group {group!r} on {subject!r} has {size} pulls pending; retry later",
            field="group",
            headers={"Retry-After": str(retry_after_s)},
        )


class DeadlineExceeded(RequestError):
    """The pull waited for a worker past its deadline; answered 503 rather than dropped."""

    def __init__(self, *, subject: str, group: str, waited_s: float) -> None:
        super().__init__(
            status=503,
            code="deadline_exceeded",
            message=(
                f"pull for group {group!r} on {subject!r} waited {waited_s:.3f}s for a worker "
                "past its deadline; the broker is overloaded, retry later"
            ),
        )


class ShuttingDown(RequestError):
    """The broker stopped before this pull could be served."""

    def __init__(self) -> None:
        super().__init__(status=503, code="shutting_down", message="the broker is shutting down")
