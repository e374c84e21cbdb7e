"""The idempotent store's vocabulary: outcomes and small shared helpers (its errors are in
``qmq_outbox.errors``)."""

from __future__ import annotations

import enum
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from qmq_outbox.envelope import Message
from qmq_outbox.failure_log import delivery, describe

if TYPE_CHECKING:
    from sqlalchemy.engine import CursorResult
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

logger = logging.getLogger("qmq_outbox.idempotent")

DEFAULT_RETENTION = timedelta(days=7)
DEFAULT_LEASE = timedelta(minutes=1)
BUSY_MARGIN = timedelta(milliseconds=100)

S = TypeVar("S", "Session", "AsyncSession")
T = TypeVar("T")
P = ParamSpec("P")


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
        "consumer group %s: expired claim of %s taken over: the previous holder died or "
        "outlived its lease",
        group,
        delivery(message),
        extra={"action": "consumer.claim_taken_over", "group": group, "message_id": message.id},
    )


def log_bookkeeping_failed(step: str, group: str, message: Message) -> None:
    """In an ``except``: the error as one line (no SQL); its traceback at DEBUG."""
    error = sys.exc_info()[1]
    logger.debug("recording %s failed", step, exc_info=error)
    logger.error(
        "consumer group %s: could not record %s for %s: %s",
        group,
        step,
        delivery(message),
        describe(error) if error is not None else "unknown error",
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


def in_session(
    sessionmaker: Any,
    step: Callable[Concatenate[Session, P], T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """``step(session, *args)`` on a new session of a sync ``sessionmaker``; ``step`` owns the
    transactions (``with session.begin(): ...``)."""
    with sessionmaker() as session:
        return step(session, *args, **kwargs)


async def in_session_async(
    sessionmaker: Any,
    step: Callable[Concatenate[Session, P], T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """The same ``step`` on an ``async_sessionmaker``'s session, through ``run_sync``: the
    store's SQL logic is written once, for a sync ``Session``."""
    async with sessionmaker() as session:
        result: T = await session.run_sync(step, *args, **kwargs)
        return result
