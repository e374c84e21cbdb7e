"""Stage items on SQLAlchemy transactions; hand them over only after the outermost commit.

Each item is buffered on the ``SessionTransaction`` (root or SAVEPOINT) that is current when
it is staged. ``after_commit`` notes which transaction just committed (it fires for root
commits *and* savepoint releases, and may not touch the database); the
``after_transaction_end`` that immediately follows it then either moves a released
savepoint's items up to its enclosing transaction or, for the root, hands them to
``on_commit``. Any other end (rollback, rollback to savepoint, close without commit) drops
them (``docs/outbox.md`` lists the event traps this avoids). Buffers are created lazily by
``stage()`` rather than in ``after_transaction_create``, which also fires for every flush's
internal subtransaction; sessions that never publish pay two dict lookups per transaction.

Listeners go on a ``sessionmaker``'s own class, a ``Session`` subclass, a ``scoped_session``
or a single session, never on ``Session`` itself; installing twice is a no-op.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, SessionTransaction, scoped_session, sessionmaker

from qmq_outbox.errors import ConfigurationError

logger = logging.getLogger(__name__)

T = TypeVar("T")
EventTarget = type[Session] | Session
_EVENTS = ("after_commit", "after_transaction_end")


def event_target(target: object) -> EventTarget:
    """The class or instance whose events cover ``target``'s sessions."""
    if isinstance(target, async_sessionmaker):
        sync_class = target.kw.get("sync_session_class")
        if sync_class is None:
            raise ConfigurationError(
                "an async_sessionmaker's sessions use the global Session class: create it "
                "with sync_session_class=sessionmaker() and install the outbox on that"
            )
        return event_target(sync_class)
    if isinstance(target, scoped_session):
        return event_target(target.session_factory)
    if isinstance(target, sessionmaker):
        session_class: type[Session] = target.class_
        return event_target(session_class)
    if isinstance(target, AsyncSession):
        return target.sync_session
    if isinstance(target, Session):
        return target
    if isinstance(target, type) and issubclass(target, Session):
        if target is Session:
            raise ConfigurationError(
                "refusing to listen on the global Session class: install on a "
                "sessionmaker, a Session subclass or a session"
            )
        return target
    raise ConfigurationError(f"cannot install on {target!r}: expected a sessionmaker or session")


def _enclosing(transaction: SessionTransaction) -> SessionTransaction | None:
    """The nearest enclosing root or SAVEPOINT transaction (skipping flush subtransactions)."""
    parent = transaction.parent
    while parent is not None and not (parent.nested or parent.parent is None):
        parent = parent.parent
    return parent


class TransactionTracker(Generic[T]):
    """Per-transaction buffers of items, released to ``on_commit`` after the root commits.

    ``on_commit`` runs inside SQLAlchemy's commit, after COMMIT returned: it must not block,
    emit SQL or touch ORM attributes. Its exceptions are logged, never raised into the commit.
    """

    def __init__(self, on_commit: Callable[[list[T]], None], *, name: str = "outbox") -> None:
        self._on_commit = on_commit
        self._key = f"qmq_outbox.{name}.{id(self)}.staged"
        self._committing = f"qmq_outbox.{name}.{id(self)}.committing"
        self._classes: set[type[Session]] = set()
        self._instances: weakref.WeakSet[Session] = weakref.WeakSet()

    def install(self, target: object) -> None:
        resolved = event_target(target)
        if not event.contains(resolved, "after_transaction_end", self._after_transaction_end):
            event.listen(resolved, "after_commit", self._after_commit)
            event.listen(resolved, "after_transaction_end", self._after_transaction_end)
        if isinstance(resolved, Session):
            self._instances.add(resolved)
        else:
            self._classes.add(resolved)

    def uninstall(self, target: object) -> None:
        resolved = event_target(target)
        if event.contains(resolved, "after_transaction_end", self._after_transaction_end):
            event.remove(resolved, "after_commit", self._after_commit)
            event.remove(resolved, "after_transaction_end", self._after_transaction_end)
        if isinstance(resolved, Session):
            self._instances.discard(resolved)
        else:
            self._classes.discard(resolved)

    def is_installed(self, session: Session) -> bool:
        return session in self._instances or any(isinstance(session, c) for c in self._classes)

    def stage(self, session: Session, item: T) -> None:
        """Buffer ``item`` on the innermost root-or-SAVEPOINT transaction of ``session``."""
        transaction = session.get_nested_transaction() or session.get_transaction()
        if transaction is None:
            raise ConfigurationError("publish() needs a session inside a transaction")
        buffers: dict[SessionTransaction, list[T]] = session.info.setdefault(self._key, {})
        buffers.setdefault(transaction, []).append(item)

    def staged(self, session: Session) -> int:
        """How many items wait on ``session``'s open transactions."""
        buffers: dict[SessionTransaction, list[T]] = session.info.get(self._key, {})
        return sum(len(items) for items in buffers.values())

    def _after_commit(self, session: Session) -> None:
        if self._key in session.info:
            committing = session.get_nested_transaction() or session.get_transaction()
            session.info[self._committing] = committing

    def _after_transaction_end(self, session: Session, transaction: SessionTransaction) -> None:
        info: dict[Any, Any] = session.info
        buffers: dict[SessionTransaction, list[T]] | None = info.get(self._key)
        if buffers is None:
            return
        committed = info.get(self._committing) is transaction
        if committed:
            del info[self._committing]
        items = buffers.pop(transaction, None)
        enclosing = _enclosing(transaction)
        if transaction.parent is None:
            del info[self._key]  # the root ended: nothing may outlive it
        if not items:
            return
        if not committed:
            logger.debug(
                "discarded %d staged message(s): transaction ended without commit",
                len(items),
                extra={"action": "outbox.discarded", "count": len(items)},
            )
        elif enclosing is not None:
            buffers.setdefault(enclosing, []).extend(items)  # savepoint released
        else:
            self._hand_off(items)

    def _hand_off(self, items: list[T]) -> None:
        try:
            self._on_commit(items)
        except Exception:
            logger.exception(
                "handing committed messages to the dispatcher failed; they stay pending",
                extra={"action": "outbox.handoff_failed", "count": len(items)},
            )
