"""Handler registration and what one delivery comes to: ack or nack (with a delay).

Plain handlers (and sync stores) run whole on a thread (``handle`` / ``handle_batch``);
coroutine handlers and async stores run on the loop (``handle_async`` / ``handle_batch_async``,
which hand the former to a thread themselves).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import qmq_wire
from qmq_outbox import tracing
from qmq_outbox.envelope import Message
from qmq_outbox.errors import ClaimHeld, ConfigurationError, RetryLater
from qmq_outbox.idempotent import IdempotentStore, NonTransactional, Outcome
from qmq_wire import rules

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

MAX_ERROR_CHARS = 2000
T = TypeVar("T")


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


class Offload(Protocol):
    """Runs a blocking call off the event loop: ``await offload(fn, *args)``."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


async def to_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """The default ``Offload``: the loop's default executor."""
    return await asyncio.to_thread(fn, *args)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    duplicate: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Nack:
    delay_ms: int | None  # None: the broker's backoff
    error: str
    # The handler's exception, for the runner's log (not a RetryLater or a held claim).
    failure: BaseException | None = dataclasses.field(default=None, compare=False)


Result = Ack | Nack
ACK = Ack()
ACK_DUPLICATE = Ack(duplicate=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HandlerSpec:
    """One registered handler: its subject, function, idempotency guard, and whether its
    subject is ordered (pulled in ``"ordered"`` mode, one key's messages at a time)."""

    subject: str
    fn: Callable[..., Any]
    guard: Guard | None
    ordered: bool = False
    tags: tuple[str, ...] = ()  # the group's tag filter (any of them); empty: none
    # Found once (``inspect`` costs microseconds, and every delivery asks).
    is_coroutine: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        coroutine = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)  # noqa: B004 - async __call__ of an object
        )
        object.__setattr__(self, "is_coroutine", coroutine)

    def _validate_tags(self) -> None:
        try:
            accepted = rules.TAG_FILTER.accepts(list(self.tags), "tags", "tags")
        except rules.Refused:
            accepted = False
        if not accepted:
            raise ConfigurationError(
                f"invalid tags {list(self.tags)!r}: 1..{qmq_wire.MAX_TAGS} distinct tags of "
                f"1..{qmq_wire.MAX_TAG} characters from A-Za-z0-9._:-"
            )
        if self.ordered:
            raise ConfigurationError("tag filters are for plain subjects, not ordered ones")

    @property
    def runs_on_thread(self) -> bool:
        """A plain handler with no store or a sync one: the whole delivery is blocking."""
        return not self.is_coroutine and (self.guard is None or not self.guard.is_async)

    @property
    def batch_limit(self) -> int:
        """How many queued messages of this subject one transaction may take.

        One for an ordered handler: a batch that fails is redone message by message, the
        ones after the failure too, and those must not run before it succeeds."""
        if isinstance(self.guard, IdempotentStore) and not self.ordered:
            return self.guard.batch_size
        return 1

    def validate(self) -> None:
        """Reject combinations that cannot work, at registration time."""
        name = self.subject
        if not qmq_wire.valid_name(name) or name.startswith(qmq_wire.RESERVED_PREFIX):
            raise ConfigurationError(f"invalid subject {self.subject!r}")
        if self.tags:
            self._validate_tags()
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
    tracing.record_failure(exc)  # on the handler's span, when tracing is on
    # Logged by the runner, which summarises a group's repeated failures.
    return Nack(delay_ms=None, error=describe(exc), failure=exc)


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


def _result(spec: HandlerSpec, group: str, message: Message, outcome: object) -> Result:
    if isinstance(outcome, Outcome):
        return _acked(outcome)
    assert isinstance(outcome, Exception)
    return _fail(spec, group, message, outcome)


async def handle_async(
    spec: HandlerSpec, group: str, message: Message, offload: Offload = to_thread
) -> Result:
    """Run a handler under asyncio: coroutines awaited, blocking work through ``offload``."""
    if spec.runs_on_thread:
        return await offload(handle, spec, group, message)
    try:
        guard = spec.guard
        if guard is None:
            await spec.fn(message)
            return ACK
        fn = spec.fn
        if not spec.is_coroutine:  # a plain handler between an async store's claim and done

            def fn(m: Message) -> Awaitable[object]:
                return offload(spec.fn, m)

        return _acked(await guard.process_async(group, message, fn))
    except Exception as exc:
        return _fail(spec, group, message, exc)


async def handle_batch_async(
    spec: HandlerSpec, group: str, messages: list[Message], offload: Offload = to_thread
) -> list[Result]:
    """``handle_batch`` under asyncio."""
    if spec.runs_on_thread:
        return await offload(handle_batch, spec, group, messages)
    if len(messages) == 1:
        return [await handle_async(spec, group, messages[0], offload)]
    guard = spec.guard
    assert isinstance(guard, IdempotentStore)
    outcomes = await guard.process_batch_async(group, messages, spec.fn)
    return [_result(spec, group, m, o) for m, o in zip(messages, outcomes, strict=True)]
