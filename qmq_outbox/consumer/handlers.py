"""Handler registration and what one delivery comes to: ack or nack (with a delay).

Shared by the threaded and the asyncio runners; only ``handle`` / ``handle_async`` differ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from qmq_outbox.consumer.errors import RetryLater
from qmq_outbox.envelope import Message
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.idempotent import ClaimHeld, IdempotentStore, NonTransactional, Outcome

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

logger = logging.getLogger(__name__)

SUBJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
MAX_ERROR_CHARS = 2000


class MessageHandler(Protocol):
    """``def handler(message)`` (or ``async def`` under ``run_async()``): return = ack."""

    def __call__(self, message: Message, /) -> object: ...


class SessionHandler(Protocol):
    """``def handler(message, session)``: writes through ``session``, never commits it."""

    def __call__(self, message: Message, session: Session, /) -> object: ...


class AsyncSessionHandler(Protocol):
    """``async def handler(message, session)`` with an ``AsyncSession``."""

    def __call__(self, message: Message, session: AsyncSession, /) -> Awaitable[object]: ...


Guard = IdempotentStore[Any] | NonTransactional[Any]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    duplicate: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Nack:
    delay_ms: int | None  # None: the broker's backoff
    error: str


Result = Ack | Nack
ACK = Ack()
ACK_DUPLICATE = Ack(duplicate=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HandlerSpec:
    """One registered handler: its subject, function and idempotency guard."""

    subject: str
    fn: Callable[..., Any]
    guard: Guard | None

    @property
    def is_coroutine(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)  # noqa: B004 - async __call__ of an object
        )

    @property
    def batch_limit(self) -> int:
        """How many queued messages of this subject one transaction may take."""
        if isinstance(self.guard, IdempotentStore):
            return self.guard.batch_size
        return 1

    def validate(self) -> None:
        """Reject combinations that cannot work, at registration time."""
        if not SUBJECT.match(self.subject) or self.subject.startswith("_qmq"):
            raise ConfigurationError(f"invalid subject {self.subject!r}")
        guard = self.guard
        if guard is None:
            return
        if not isinstance(guard, IdempotentStore | NonTransactional):
            raise ConfigurationError(
                "idempotent= takes an IdempotentStore or its non_transactional()"
            )
        if guard.transactional and guard.is_async != self.is_coroutine:
            raise ConfigurationError(
                "an IdempotentStore on an async_sessionmaker needs an `async def` handler, "
                "one on a sessionmaker a plain `def` handler"
            )
        if not guard.transactional and not guard.is_async and self.is_coroutine:
            raise ConfigurationError(
                "a sync store's non_transactional() needs a plain `def` handler"
            )

    def check_threaded(self) -> None:
        """``run()`` calls handlers on threads: no coroutines, no async stores."""
        if self.is_coroutine or (self.guard is not None and self.guard.is_async):
            raise ConfigurationError(
                f"handler for {self.subject!r} is async (or uses an async store): use run_async()"
            )


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text[:MAX_ERROR_CHARS]


def _fail(spec: HandlerSpec, group: str, message: Message, exc: BaseException) -> Result:
    if isinstance(exc, RetryLater):
        return Nack(delay_ms=exc.delay_ms, error=describe(exc))
    if isinstance(exc, ClaimHeld):
        delay_ms = round(exc.retry_after.total_seconds() * 1000)
        return Nack(delay_ms=delay_ms, error=describe(exc))
    logger.warning(
        "handler failed",
        exc_info=exc,
        extra={
            "action": "consumer.handler_failed",
            "group": group,
            "subject": message.subject,
            "seq": message.seq,
            "message_id": message.id,
            "attempt": message.attempt,
        },
    )
    return Nack(delay_ms=None, error=describe(exc))


def _acked(outcome: Outcome) -> Ack:
    return ACK_DUPLICATE if outcome is Outcome.DUPLICATE else ACK


def handle(spec: HandlerSpec, group: str, message: Message) -> Result:
    """Run a handler on this thread; its exceptions become nacks."""
    try:
        if spec.guard is None:
            spec.fn(message)
            return ACK
        return _acked(spec.guard.process(group, message, spec.fn))
    except Exception as exc:
        return _fail(spec, group, message, exc)


def handle_batch(spec: HandlerSpec, group: str, messages: list[Message]) -> list[Result]:
    """Several messages of one subject through the store's batch; one result each."""
    if len(messages) == 1:
        return [handle(spec, group, messages[0])]
    assert isinstance(spec.guard, IdempotentStore)
    outcomes = spec.guard.process_batch(group, messages, spec.fn)
    return [_result(spec, group, m, o) for m, o in zip(messages, outcomes, strict=True)]


async def handle_batch_async(
    spec: HandlerSpec, group: str, messages: list[Message]
) -> list[Result]:
    if len(messages) == 1:
        return [await handle_async(spec, group, messages[0])]
    guard = spec.guard
    assert isinstance(guard, IdempotentStore)
    if guard.is_async:
        outcomes = await guard.process_batch_async(group, messages, spec.fn)
    else:
        outcomes = await asyncio.to_thread(guard.process_batch, group, messages, spec.fn)
    return [_result(spec, group, m, o) for m, o in zip(messages, outcomes, strict=True)]


def _result(spec: HandlerSpec, group: str, message: Message, outcome: object) -> Result:
    if isinstance(outcome, Outcome):
        return _acked(outcome)
    assert isinstance(outcome, Exception)
    return _fail(spec, group, message, outcome)


async def handle_async(spec: HandlerSpec, group: str, message: Message) -> Result:
    """Run a handler under asyncio: coroutines awaited, plain functions on a worker thread."""
    try:
        guard = spec.guard
        if guard is None:
            if spec.is_coroutine:
                await spec.fn(message)
            else:
                await asyncio.to_thread(spec.fn, message)
            return ACK
        if not guard.is_async:
            return _acked(await asyncio.to_thread(guard.process, group, message, spec.fn))
        fn = spec.fn
        if not guard.transactional and not spec.is_coroutine:

            def fn(m: Message) -> Awaitable[object]:
                return asyncio.to_thread(spec.fn, m)

        return _acked(await guard.process_async(group, message, fn))
    except Exception as exc:
        return _fail(spec, group, message, exc)
