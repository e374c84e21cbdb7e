"""Non-transactional mode, for handlers whose effects are outside the database.

A *processing* row with a lease is committed first, the handler runs outside any
transaction, then the row becomes *done*. A crash leaves the lease, which expires, so the
message is processed again, never skipped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Generic

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from qmq_outbox.envelope import Message
from qmq_outbox.errors import ClaimHeld, ConfigurationError, IdempotentStoreError
from qmq_outbox.idempotent import rows
from qmq_outbox.idempotent.base import (
    BUSY_MARGIN,
    Outcome,
    S,
    in_session,
    in_session_async,
    log_bookkeeping_failed,
    log_takeover,
    rowcount,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from qmq_outbox.idempotent.store import IdempotentStore


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

    # The SQL steps are written once, for a sync ``Session`` (each step owns its short
    # transactions); the async variant runs them through ``AsyncSession.run_sync``.

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
        sm = self.store.sessionmaker
        until = in_session(sm, self._claim, group, message)
        if until is None:
            return Outcome.DUPLICATE
        try:
            handler(message)
        except BaseException:
            in_session(sm, self._release, group, message, until)
            raise
        in_session(sm, self._done, group, message)
        return Outcome.PROCESSED

    async def process_async(
        self: NonTransactional[AsyncSession],
        group: str,
        message: Message,
        handler: Callable[[Message], object],
    ) -> Outcome:
        """``process`` with ``AsyncSession``; an awaitable the handler returns is awaited."""
        sm = self.store.sessionmaker
        until = await in_session_async(sm, self._claim, group, message)
        if until is None:
            return Outcome.DUPLICATE
        try:
            result = handler(message)
            if inspect.isawaitable(result):
                await result
        except BaseException:
            await in_session_async(sm, self._release, group, message, until)
            raise
        await in_session_async(sm, self._done, group, message)
        return Outcome.PROCESSED

    def _claim(self, session: Session, group: str, message: Message) -> datetime | None:
        """Our lease's end when we may run the handler; None when already done."""
        try:
            for _ in range(3):
                now = self.store.now()
                until = now + self.lease
                try:
                    with session.begin():
                        claim = rows.insert_processing(group, message.id, now=now, until=until)
                        session.execute(*claim)
                    return until
                except IntegrityError as exc:
                    if not rows.is_duplicate(exc):
                        raise
                with session.begin():
                    update = rows.take_over_expired(group, message.id, now=now, until=until)
                    if rowcount(session.execute(*update)) == 1:
                        log_takeover(group, message)
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

    def _done(self, session: Session, group: str, message: Message) -> None:
        try:
            with session.begin():
                session.execute(*rows.mark_done(group, message.id, now=self.store.now()))
        except SQLAlchemyError:
            # The effect happened: ack anyway. The claim's lease just ages out unused.
            log_bookkeeping_failed("done", group, message)

    def _release(self, session: Session, group: str, message: Message, until: datetime) -> None:
        try:
            with session.begin():
                session.execute(*rows.release(group, message.id, until=until))
        except SQLAlchemyError:
            log_bookkeeping_failed("release", group, message)
