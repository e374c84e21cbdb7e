"""``IdempotentStore``: a handler's database effects happen once per consumer group.

Transactional mode (``idempotent=store``): the dedup row and the handler's writes are one
transaction on the session handed to the handler. A redelivered message's insert violates
``pk_qmq_consumed`` (on PostgreSQL a concurrent twin's insert waits for the first
transaction and then violates it), so it is skipped and acked. Nothing is ever recorded
without the handler's writes, so a crash cannot turn into a skipped message.

Non-transactional mode (``idempotent=store.non_transactional()``), for effects outside the
database: a *processing* row with a lease is committed first, then *done* after the handler.
A crash leaves the lease, which expires, so the message is processed again, never skipped.
"""

from __future__ import annotations

import enum
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from qmq_outbox.envelope import Message
from qmq_outbox.errors import ConfigurationError, QmqError
from qmq_outbox.idempotent import rows

if TYPE_CHECKING:
    from sqlalchemy.engine import CursorResult
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session, sessionmaker

logger = logging.getLogger(__name__)

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


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _is_async_sessionmaker(factory: object) -> bool:
    # Imported lazily: sqlalchemy.ext.asyncio needs greenlet, which sync users may not have.
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    return module is not None and isinstance(factory, module.async_sessionmaker)


def _rowcount(result: Any) -> int:
    return int(cast("CursorResult[Any]", result).rowcount)


class IdempotentStore(Generic[S]):
    """Dedup rows in ``qmq_consumed`` on your database, through your sessionmaker.

    ``retention`` is how long *done* rows are kept (``gc()`` deletes older ones); keep it
    longer than a message can be redelivered (the broker's dedup window, 7 days by default).
    ``lease`` is the non-transactional mode's claim: longer than the handler ever runs.
    Timestamps come from this process's clock in UTC; hosts' clocks should agree to well
    within the lease.
    """

    transactional = True

    @overload
    def __init__(
        self: IdempotentStore[Session],
        sessionmaker: sessionmaker[Session],
        *,
        retention: timedelta = ...,
        lease: timedelta = ...,
        clock: Callable[[], datetime] | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: IdempotentStore[AsyncSession],
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        retention: timedelta = ...,
        lease: timedelta = ...,
        clock: Callable[[], datetime] | None = ...,
    ) -> None: ...

    def __init__(
        self,
        sessionmaker: Any,
        *,
        retention: timedelta = DEFAULT_RETENTION,
        lease: timedelta = DEFAULT_LEASE,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if retention <= timedelta(0) or lease <= timedelta(0):
            raise ConfigurationError("retention and lease must be positive")
        self.sessionmaker = sessionmaker
        self.retention = retention
        self.lease = lease
        self._clock = clock or _utcnow
        self.is_async = _is_async_sessionmaker(sessionmaker)

    def now(self) -> datetime:
        return self._clock()

    def non_transactional(self, *, lease: timedelta | None = None) -> NonTransactional[S]:
        """The mode for handlers with outside effects (handler signature ``(message)``)."""
        return NonTransactional(self, lease=lease or self.lease)

    # -- transactional mode -------------------------------------------------------------

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

    def _insert_done(self, session: Session, group: str, message_id: str) -> None:
        try:
            session.execute(*rows.insert_done(group, message_id, now=self.now()))
        except IntegrityError as exc:
            if rows.is_duplicate(exc):
                raise DuplicateMessage(f"{group}/{message_id} already consumed") from exc
            raise IdempotentStoreError(f"dedup insert failed: {exc.orig}") from exc
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"dedup insert failed: {exc}") from exc

    async def process_async(
        self: IdempotentStore[AsyncSession],
        group: str,
        message: Message,
        handler: Callable[[Message, AsyncSession], Awaitable[object]],
    ) -> Outcome:
        """``process`` for ``AsyncSession``: ``await handler(message, session)``."""
        try:
            async with self.sessionmaker() as session, session.begin():
                await self._insert_done_async(session, group, message.id)
                await handler(message, session)
        except DuplicateMessage:
            return Outcome.DUPLICATE
        return Outcome.PROCESSED

    async def _insert_done_async(self, session: AsyncSession, group: str, message_id: str) -> None:
        try:
            await session.execute(*rows.insert_done(group, message_id, now=self.now()))
        except IntegrityError as exc:
            if rows.is_duplicate(exc):
                raise DuplicateMessage(f"{group}/{message_id} already consumed") from exc
            raise IdempotentStoreError(f"dedup insert failed: {exc.orig}") from exc
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"dedup insert failed: {exc}") from exc

    # -- retention ----------------------------------------------------------------------

    def gc(self: IdempotentStore[Session], *, batch_size: int = 10_000) -> int:
        """Delete rows older than the retention, in batches; returns how many."""
        cutoff = self.now() - self.retention
        total = 0
        try:
            while True:
                with self.sessionmaker() as session, session.begin():
                    deleted = _rowcount(
                        session.execute(rows.gc_batch(cutoff=cutoff, limit=batch_size))
                    )
                total += deleted
                if deleted < batch_size:
                    break
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"gc failed after {total} rows: {exc}") from exc
        logger.info("consumed rows purged", extra={"action": "consumer.gc", "deleted": total})
        return total

    async def gc_async(self: IdempotentStore[AsyncSession], *, batch_size: int = 10_000) -> int:
        """``gc`` for ``AsyncSession``."""
        cutoff = self.now() - self.retention
        total = 0
        try:
            while True:
                async with self.sessionmaker() as session, session.begin():
                    result = await session.execute(rows.gc_batch(cutoff=cutoff, limit=batch_size))
                    deleted = _rowcount(result)
                total += deleted
                if deleted < batch_size:
                    break
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"gc failed after {total} rows: {exc}") from exc
        logger.info("consumed rows purged", extra={"action": "consumer.gc", "deleted": total})
        return total


class NonTransactional(Generic[S]):
    """Non-transactional mode: *processing* with a lease, then *done*.

    A delivery whose row is *done* is skipped (acked). One whose row is *processing* under
    an unexpired lease belongs to a live twin: it is retried after the lease (``ClaimHeld``,
    which the consumer nacks with that delay). An expired lease means the holder died: the
    message is processed again. The handler's effect therefore happens at least once and,
    unless a holder dies mid-effect or outlives its lease, exactly once.
    """

    transactional = False

    def __init__(self, store: IdempotentStore[S], *, lease: timedelta) -> None:
        if lease <= timedelta(0):
            raise ConfigurationError("lease must be positive")
        self.store: IdempotentStore[S] = store
        self.lease = lease

    @property
    def is_async(self) -> bool:
        return self.store.is_async

    def _busy(self, group: str, message: Message, state: rows.RowState) -> ClaimHeld:
        now = self.store.now()
        until = state.lease_until or now
        wait = max(until - now, timedelta(0)) + BUSY_MARGIN
        return ClaimHeld(f"{group}/{message.id} is being processed until {until}", retry_after=wait)

    # -- sync -------------------------------------------------------------------------

    def process(
        self: NonTransactional[Session],
        group: str,
        message: Message,
        handler: Callable[[Message], object],
    ) -> Outcome:
        """Claim, run ``handler(message)`` outside any transaction, record *done*.

        Raises ``ClaimHeld`` while a live twin holds the claim; a handler exception
        releases the claim and propagates.
        """
        until = self._claim(group, message)
        if until is None:
            return Outcome.DUPLICATE
        try:
            handler(message)
        except BaseException:
            self._release(group, message, until)
            raise
        self._done(group, message)
        return Outcome.PROCESSED

    def _claim(self, group: str, message: Message) -> datetime | None:
        """Our lease's end when we may run the handler; None when already done."""
        sm = self.store.sessionmaker
        try:
            for _ in range(3):
                now = self.store.now()
                until = now + self.lease
                try:
                    with sm() as session, session.begin():
                        claim = rows.insert_processing(group, message.id, now=now, until=until)
                        session.execute(*claim)
                    return until
                except IntegrityError as exc:
                    if not rows.is_duplicate(exc):
                        raise
                with sm() as session, session.begin():
                    update = rows.take_over_expired(group, message.id, now=now, until=until)
                    if _rowcount(session.execute(*update)) == 1:
                        _log_takeover(group, message)
                        return until
                    found = session.execute(*rows.select_state(group, message.id)).one_or_none()
                if found is None:
                    continue  # released between our statements: try the insert again
                state = rows.RowState.from_row(found)
                if state.status == rows.DONE:
                    return None
                raise self._busy(group, message, state)
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"claim failed: {exc}") from exc
        raise ClaimHeld(f"{group}/{message.id} claim kept changing", retry_after=BUSY_MARGIN)

    def _done(self, group: str, message: Message) -> None:
        try:
            with self.store.sessionmaker() as session, session.begin():
                session.execute(*rows.mark_done(group, message.id, now=self.store.now()))
        except SQLAlchemyError:
            # The effect happened: ack anyway. The claim's lease just ages out unused.
            _log_bookkeeping_failed("done", group, message)

    def _release(self, group: str, message: Message, until: datetime) -> None:
        try:
            with self.store.sessionmaker() as session, session.begin():
                session.execute(*rows.release(group, message.id, until=until))
        except SQLAlchemyError:
            _log_bookkeeping_failed("release", group, message)

    # -- async ------------------------------------------------------------------------

    async def process_async(
        self: NonTransactional[AsyncSession],
        group: str,
        message: Message,
        handler: Callable[[Message], object],
    ) -> Outcome:
        """``process`` with ``AsyncSession``; an awaitable the handler returns is awaited."""
        until = await self._claim_async(group, message)
        if until is None:
            return Outcome.DUPLICATE
        try:
            result = handler(message)
            if inspect.isawaitable(result):
                await result
        except BaseException:
            await self._release_async(group, message, until)
            raise
        await self._done_async(group, message)
        return Outcome.PROCESSED

    async def _claim_async(self, group: str, message: Message) -> datetime | None:
        sm = self.store.sessionmaker
        try:
            for _ in range(3):
                now = self.store.now()
                until = now + self.lease
                try:
                    async with sm() as session, session.begin():
                        insert = rows.insert_processing(group, message.id, now=now, until=until)
                        await session.execute(*insert)
                    return until
                except IntegrityError as exc:
                    if not rows.is_duplicate(exc):
                        raise
                async with sm() as session, session.begin():
                    update = rows.take_over_expired(group, message.id, now=now, until=until)
                    if _rowcount(await session.execute(*update)) == 1:
                        _log_takeover(group, message)
                        return until
                    result = await session.execute(*rows.select_state(group, message.id))
                    found = result.one_or_none()
                if found is None:
                    continue
                state = rows.RowState.from_row(found)
                if state.status == rows.DONE:
                    return None
                raise self._busy(group, message, state)
        except SQLAlchemyError as exc:
            raise IdempotentStoreError(f"claim failed: {exc}") from exc
        raise ClaimHeld(f"{group}/{message.id} claim kept changing", retry_after=BUSY_MARGIN)

    async def _done_async(self, group: str, message: Message) -> None:
        try:
            async with self.store.sessionmaker() as session, session.begin():
                await session.execute(*rows.mark_done(group, message.id, now=self.store.now()))
        except SQLAlchemyError:
            _log_bookkeeping_failed("done", group, message)

    async def _release_async(self, group: str, message: Message, until: datetime) -> None:
        try:
            async with self.store.sessionmaker() as session, session.begin():
                await session.execute(*rows.release(group, message.id, until=until))
        except SQLAlchemyError:
            _log_bookkeeping_failed("release", group, message)


def _log_takeover(group: str, message: Message) -> None:
    logger.warning(
        "expired claim taken over: the previous holder died or outlived its lease",
        extra={"action": "consumer.claim_taken_over", "group": group, "message_id": message.id},
    )


def _log_bookkeeping_failed(step: str, group: str, message: Message) -> None:
    logger.error(
        "could not record %s for a consumed message",
        step,
        exc_info=True,
        extra={"action": f"consumer.claim_{step}_failed", "group": group, "message_id": message.id},
    )
