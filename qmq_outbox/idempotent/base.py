"""The idempotent store's vocabulary: outcomes, errors, and small shared helpers."""

from __future__ import annotations

import enum
import logging
import sys
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from qmq_outbox.envelope import Message
from qmq_outbox.errors import QmqError

if TYPE_CHECKING:
    from sqlalchemy.engine import CursorResult
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

logger = logging.getLogger("qmq_outbox.idempotent")

DEFAULT_RETENTION = timedelta(days=7)
DEFAULT_LEASE = timedelta(minutes=1)
BUSY_MARGIN = timedelta(milliseconds=100)

S = TypeVar("S", "Session", "AsyncSession")


class IdempotentStoreError(QmqError):
    """The idempotent store's own database statement failed (the cause is chained)."""


class DuplicateMessage(QmqError):
    """This consumer group already consumed the message (the ``pk_qmq_consumed`` violation)."""


class ClaimHeld(QmqError):
    """Another consumer holds an unexpired claim on this message: retry after ``retry_after``."""

    def __init__(self, message: str, *, retry_after: timedelta) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Outcome(enum.Enum):
    """What the store did with a delivery; both mean the message can be acked."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"


def utcnow() -> datetime:
    return datetime.now(UTC)


def is_async_sessionmaker(factory: object) -> bool:
    # Looked up lazily: sqlalchemy.ext.asyncio needs greenlet, which sync users may not have.
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    return module is not None and isinstance(factory, module.async_sessionmaker)


def rowcount(result: Any) -> int:
    return int(cast("CursorResult[Any]", result).rowcount)


def log_takeover(group: str, message: Message) -> None:
    logger.warning(
        "expired claim taken over: the previous holder died or outlived its lease",
        extra={"action": "consumer.claim_taken_over", "group": group, "message_id": message.id},
    )


def log_bookkeeping_failed(step: str, group: str, message: Message) -> None:
    logger.error(
        "could not record %s for a consumed message",
        step,
        exc_info=True,
        extra={"action": f"consumer.claim_{step}_failed", "group": group, "message_id": message.id},
    )


def log_batch_fallback(group: str, size: int, exc: Exception) -> None:
    logger.info(
        "batch rolled back; processing its messages one by one",
        extra={
            "action": "consumer.batch_fallback",
            "group": group,
            "size": size,
            "error": f"{type(exc).__name__}: {exc}"[:500],
        },
    )
