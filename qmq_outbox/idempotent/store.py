"""``IdempotentStore``: a handler's database effects happen once per consumer group.

Transactional mode (``idempotent=store``): the dedup row and the handler's writes are one
transaction on the session handed to the handler. A redelivered message's insert violates
``pk_qmq_consumed`` (on PostgreSQL a concurrent twin's insert waits for the first
transaction and then violates it), so it is skipped and acked. Nothing is ever recorded
without the handler's writes, so a crash cannot turn into a skipped message.

With ``batch_size > 1`` several queued messages share one transaction: their dedup rows go
in with one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` (rows that already exist, or
that a twin is committing, come back missing: duplicates), their handlers run in order on
one session, one commit. If anything fails, the transaction rolls back and each message is
processed again on its own, so only the failing one fails.

The non-transactional mode lives in ``claims.py`` (``store.non_transactional()``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from qmq_outbox.envelope import Message
from qmq_outbox.errors import ConfigurationError, DuplicateMessage, IdempotentStoreError
from qmq_outbox.idempotent import rows
from qmq_outbox.idempotent.base import (
    DEFAULT_LEASE,
    DEFAULT_RETENTION,
    Outcome,
    S,
    in_session,
    in_session_async,
    is_async_sessionmaker,
    log_batch_fallback,
    logger,
    rowcount,
    utcnow,
)
from qmq_outbox.idempotent.claims import NonTransactional

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

BatchResult = list[Outcome | Exception]


class IdempotentStore(Generic[S]):
    """Dedup rows in ``qmq_consumed`` on your database, through your sessionmaker.

    ``retention`` is how long *done* rows are kept (``gc()`` deletes older ones); keep it
    longer than a message can be redelivered (the broker's dedup window, 7 days by default).
    ``lease`` is the non-transactional mode's claim: longer than the handler ever runs.
    ``batch_size`` lets the consumer commit up to that many queued messages of a subject in
    one transaction (PostgreSQL and SQLite; 1 = one transaction per message).
    Timestamps come from this process's clock in UTC; hosts' clocks should agree to well
    within the lease.
    """

    transactional = True

    def __init__(
        self,
        sessionmaker: Callable[[], S],
        *,
        retention: timedelta = DEFAULT_RETENTION,
        lease: timedelta = DEFAULT_LEASE,
        batch_size: int = 1,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if retention <= timedelta(0) or lease <= timedelta(0) or batch_size < 1:
            raise ConfigurationError("retention and lease must be positive, batch_size >= 1")
        self.sessionmaker: Any = sessionmaker  # a sessionmaker or an async_sessionmaker
        self.retention = retention
        self.lease = lease
        self.batch_size = batch_size
        self._clock = clock or utcnow
        self.is_async = is_async_sessionmaker(sessionmaker)

    def now(self) -> datetime:
        return self._clock()

    def non_transactional(self, *, lease: timedelta | None = None) -> NonTransactional[S]:
        """The mode for handlers with outside effects (handler signature ``(message)``)."""
        return NonTransactional(self, lease=lease or self.lease)

    # -- one message per transaction ----------------------------------------------------
    # The SQL is written once, on a sync ``Session``; the async variants run it through
    # ``AsyncSession.run_sync`` and differ only in awaiting the handler. The store's own
    # statements are Core, run on the session's connection (in its transaction): they need
    # nothing of the ORM's execution.

    def process(
        self: IdempotentStore[Session],
        group: str,
        message: Message,
        handler: Callable[[Message, Session], object],
    ) -> Outcome:
        """Insert the dedup row, run ``handler(message, session)``, commit both, or neither.

        The store owns this session and transaction: the handler must not commit it.
        A handler exception rolls everything back and propagates.
        """
        try:
            with self.sessionmaker() as session, session.begin():
                self._insert_done(session, group, message.id)
                handler(message, session)
        except DuplicateMessage:
            return Outcome.DUPLICATE
        return Outcome.PROCESSED

    async def process_async(
        self: IdempotentStore[AsyncSession],
        group: str,
        message: Message,
        handler: Callable[[Message, AsyncSession], Awaitable[object]],
    ) -> Outcome:
        """``process`` for ``AsyncSession``: ``await handler(message, session)``."""
        try:
            async with self.sessionmaker() as session, session.begin():
                await session.run_sync(self._insert_done, group, message.id)
                await handler(message, session)
        except DuplicateMessage:
            return Outcome.DUPLICATE
        return Outcome.PROCESSED

    def _insert_done(self, session: Session, group: str, message_id: str) -> None:
        try:
            session.connection().execute(*rows.insert_done(group, message_id, now=self.now()))
        except IntegrityError as exc:
            raise _translate(exc, group, message_id) from exc
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"dedup insert failed: {exc}") from exc

    # -- several messages per transaction -----------------------------------------------

    def process_batch(
        self: IdempotentStore[Session],
        group: str,
        messages: Sequence[Message],
        handler: Callable[[Message, Session], object],
    ) -> BatchResult:
        """``process`` for several messages in one transaction; one result per message: its
        ``Outcome``, or the exception its handler raised (then processed on its own)."""
        if len(messages) > 1:
            try:
                with self.sessionmaker() as session, session.begin():
                    outcomes = self._insert_batch(session, group, messages)
                    if outcomes is not None:
                        for message in _to_run(messages, outcomes):
                            handler(message, session)
                        return list(outcomes)
            except Exception as exc:
                log_batch_fallback(group, len(messages), exc)
        return [_captured(self.process, group, message, handler) for message in messages]

    async def process_batch_async(
        self: IdempotentStore[AsyncSession],
        group: str,
        messages: Sequence[Message],
        handler: Callable[[Message, AsyncSession], Awaitable[object]],
    ) -> BatchResult:
        """``process_batch`` for ``AsyncSession``."""
        if len(messages) > 1:
            try:
                async with self.sessionmaker() as session, session.begin():
                    outcomes = await session.run_sync(self._insert_batch, group, messages)
                    if outcomes is not None:
                        for message in _to_run(messages, outcomes):
                            await handler(message, session)
                        return list(outcomes)
            except Exception as exc:
                log_batch_fallback(group, len(messages), exc)
        results: BatchResult = []
        for message in messages:
            try:
                results.append(await self.process_async(group, message, handler))
            except Exception as exc:
                results.append(exc)
        return results

    def _insert_batch(
        self, session: Session, group: str, messages: Sequence[Message]
    ) -> list[Outcome] | None:
        """Insert a batch's dedup rows; each message's outcome, None where the dialect
        cannot do it in one statement."""
        dialect = session.get_bind().dialect.name
        insert = rows.insert_done_many(dialect, group, messages, now=self.now())
        if insert is None:
            return None
        fresh = set(session.connection().execute(*insert).scalars())
        return [_claim(fresh, message) for message in messages]

    # -- retention ----------------------------------------------------------------------

    def gc(self: IdempotentStore[Session], *, batch_size: int = 10_000) -> int:
        """Delete rows older than the retention, in batches; returns how many."""
        return in_session(self.sessionmaker, self._gc, batch_size)

    async def gc_async(self: IdempotentStore[AsyncSession], *, batch_size: int = 10_000) -> int:
        """``gc`` for ``AsyncSession``."""
        return await in_session_async(self.sessionmaker, self._gc, batch_size)

    def _gc(self, session: Session, batch_size: int) -> int:
        cutoff = self.now() - self.retention
        total = 0
        try:
            while True:
                with session.begin():
                    batch = rows.gc_batch(cutoff=cutoff, limit=batch_size)
                    deleted = rowcount(session.execute(batch))
                total += deleted
                if deleted < batch_size:
                    break
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"gc failed after {total} rows: {exc}") from exc
        logger.info("consumed rows purged", extra={"action": "consumer.gc", "deleted": total})
        return total


def _translate(exc: IntegrityError, group: str, message_id: str) -> Exception:
    if rows.is_duplicate(exc):
        return DuplicateMessage(f"{group}/{message_id} already consumed")
    return IdempotentStoreError(f"dedup insert failed: {exc.orig}")


def _to_run(messages: Sequence[Message], outcomes: list[Outcome]) -> list[Message]:
    return [m for m, o in zip(messages, outcomes, strict=True) if o is Outcome.PROCESSED]


def _captured(
    process: Callable[[str, Message, Any], Outcome], group: str, message: Message, handler: Any
) -> Outcome | Exception:
    try:
        return process(group, message, handler)
    except Exception as exc:
        return exc


def _claim(fresh: set[str], message: Message) -> Outcome:
    """A batch's message runs if its row was inserted now, and only its first copy does."""
    if message.id in fresh:
        fresh.discard(message.id)
        return Outcome.PROCESSED
    return Outcome.DUPLICATE
