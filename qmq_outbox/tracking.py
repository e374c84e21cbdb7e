"""Stage items on SQLAlchemy transactions; hand them over only after the outermost commit.

Each item is buffered on the ``SessionTransaction`` (root or SAVEPOINT) that is current when
it is staged. ``after_commit`` notes which transaction just committed (it fires for root
commits *and* savepoint releases, and may not touch the database); the
``after_transaction_end`` that immediately follows it then either moves a released
savepoint's items up to its enclosing transaction or, for the root, hands them to
``on_commit``. Any other end (rollback, rollback to savepoint, close without commit) drops
them (``docs/outbox.md`` lists the event traps this avoids). Buffers are created lazily by
``stage()`` rather than in ``after_transaction_create``, which also fires for every flush's
internal subtransaction; sessions that never publish pay a dict lookup per event.
An optional ``write`` callback puts staged items in the database: the outbox's rows. It runs
with the items not yet written at the start of every flush and in ``before_commit`` (a root
commit or a savepoint's release), so they are in before COMMIT whether or not the session has
ORM changes of its own. A savepoint rolled back takes the writes made inside it along: the
items among them that outlive it (staged on an enclosing transaction) are written again.

Listeners go on a ``sessionmaker``'s own class, a ``Session`` subclass, a ``scoped_session``
or a single session. Installing an *engine* (``Engine`` or ``AsyncEngine``) instead covers
every session bound to it, however it was made (``Session(engine)``, ``AsyncSession(engine)``,
any sessionmaker): the listeners then go on the ``Session`` class, registered with
the first engine and removed with the last, and they return at once for any session this
tracker staged nothing on, which ``Outbox.publish`` allows only for sessions bound to an
installed engine (or covered by the targets above). Installing twice is a no-op.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, MutableSet
from typing import Any, Generic, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, SessionTransaction, scoped_session, sessionmaker

from qmq_outbox.errors import ConfigurationError

logger = logging.getLogger(__name__)

T = TypeVar("T")
EventTarget = type[Session] | Session
Hooks = list[tuple[str, Callable[..., None]]]  # (session event, listener)


def resolve_target(target: object) -> EventTarget | Engine:
    """The engine, or the class or instance whose events cover ``target``'s sessions.

    An ``async_sessionmaker`` with a ``sync_session_class`` resolves to that class; without
    one its sessions are plain ``Session`` objects, so it resolves to the engine it is bound to.
    """
    if isinstance(target, AsyncEngine):
        return target.sync_engine
    if isinstance(target, Engine):
        return target
    if isinstance(target, async_sessionmaker):
        sync_class = target.kw.get("sync_session_class")
        if sync_class is not None:
            return resolve_target(sync_class)
        bind = target.kw.get("bind")
        if isinstance(bind, AsyncEngine | Engine):
            return resolve_target(bind)
        raise ConfigurationError(
            "this async_sessionmaker has no engine to install on: install the engine its "
            "sessions use (outbox.install(engine)), or create it with "
            "sync_session_class=sessionmaker()"
        )
    if isinstance(target, scoped_session):
        return resolve_target(target.session_factory)
    if isinstance(target, sessionmaker):
        session_class: type[Session] = target.class_
        return resolve_target(session_class)
    if isinstance(target, AsyncSession):
        return target.sync_session
    if isinstance(target, Session):
        return target
    if isinstance(target, type) and issubclass(target, Session):
        if target is Session:
            raise ConfigurationError(
                "refusing to listen on the global Session class for every engine: install "
                "the engine (outbox.install(engine)), a sessionmaker or a session"
            )
        return target
    raise ConfigurationError(
        f"cannot install on {target!r}: expected an engine, a sessionmaker or a session"
    )


def engine_of(bind: Engine | Connection | None) -> Engine | None:
    """The engine behind a session's bind (a connection's engine), None if unbound."""
    return bind.engine if isinstance(bind, Connection) else bind


def _enclosing(transaction: SessionTransaction) -> SessionTransaction | None:
    """The nearest enclosing root or SAVEPOINT transaction (skipping flush subtransactions)."""
    parent = transaction.parent
    while parent is not None and not (parent.nested or parent.parent is None):
        parent = parent.parent
    return parent


def _listen(target: EventTarget, hooks: Hooks) -> None:
    for name, hook in hooks:
        if not event.contains(target, name, hook):  # installing twice is a no-op
            event.listen(target, name, hook)


def _unlisten(target: EventTarget, hooks: Hooks) -> None:
    for name, hook in hooks:
        if event.contains(target, name, hook):
            event.remove(target, name, hook)


class TransactionTracker(Generic[T]):
    """Per-transaction buffers of items, released to ``on_commit`` after the root commits.

    ``on_commit`` runs inside SQLAlchemy's commit, after COMMIT returned: it must not block,
    emit SQL or touch ORM attributes. Its exceptions are logged, never raised into the commit.
    """

    def __init__(
        self,
        on_commit: Callable[[list[T]], None],
        *,
        name: str = "outbox",
        write: Callable[[Session, list[T]], None] | None = None,
    ) -> None:
        self._on_commit = on_commit
        self._write = write
        self._key = f"qmq_outbox.{name}.{id(self)}.staged"
        self._committing = f"qmq_outbox.{name}.{id(self)}.committing"
        self._classes: set[type[Session]] = set()
        self._instances: weakref.WeakSet[Session] = weakref.WeakSet()
        self._engines: weakref.WeakSet[Engine] = weakref.WeakSet()

    def install(self, target: object) -> None:
        """Cover ``target``'s sessions (see ``resolve_target`` for what it may be)."""
        resolved = resolve_target(target)
        if isinstance(resolved, Engine):
            self._engines.add(resolved)
            _listen(Session, self._session_wide_hooks())
            return
        _listen(resolved, self._hooks())
        self._own_listeners(resolved).add(resolved)

    def uninstall(self, target: object) -> None:
        """Stop covering ``target``'s sessions; items they staged already are not handed off."""
        resolved = resolve_target(target)
        if isinstance(resolved, Engine):
            self._engines.discard(resolved)
            if not self._engines:
                _unlisten(Session, self._session_wide_hooks())
            return
        _unlisten(resolved, self._hooks())
        self._own_listeners(resolved).discard(resolved)

    def _own_listeners(self, resolved: EventTarget) -> MutableSet[Any]:
        """Where ``resolved`` is kept while it has listeners of its own: with the sessions
        or with the classes (``_listens_on``)."""
        return self._instances if isinstance(resolved, Session) else self._classes

    def is_installed(self, session: Session, bind: Engine | Connection | None = None) -> bool:
        """Whether ``session`` is covered; ``bind`` is the bind it writes through (default:
        ``session.bind``). An engine covers its ``execution_options()`` copies too (they
        share its pool)."""
        if self._listens_on(session):
            return True
        engine = engine_of(bind if bind is not None else session.bind)
        if engine is None:
            return False
        # the engine itself (the usual case), or a copy sharing its pool
        return engine in self._engines or any(engine.pool is e.pool for e in self._engines)

    def _listens_on(self, session: Session) -> bool:
        """Whether a class or instance listener of this tracker fires for ``session``
        (asked by every session-wide hook: an engine's install alone answers at once)."""
        if self._instances and session in self._instances:
            return True
        return bool(self._classes) and any(isinstance(session, c) for c in self._classes)

    def _hooks(self) -> Hooks:
        """The events a class or instance target is listened on for, with their hooks."""
        return self._events(self._after_commit, self._after_transaction_end, self._flush)

    def _session_wide_hooks(self) -> Hooks:
        """The same events on the ``Session`` class, for the installed engines."""
        return self._events(
            self._session_wide_commit, self._session_wide_end, self._session_wide_flush
        )

    def _events(
        self,
        after_commit: Callable[[Session], None],
        after_end: Callable[[Session, SessionTransaction], None],
        flush: Callable[..., None],
    ) -> Hooks:
        hooks: Hooks = [("after_commit", after_commit), ("after_transaction_end", after_end)]
        if self._write is not None:  # rows to write: at every flush and before COMMIT
            hooks += [("before_flush", flush), ("before_commit", flush)]
        return hooks

    def stage(self, session: Session, item: T) -> None:
        """Buffer ``item`` on the innermost root-or-SAVEPOINT transaction of ``session``,
        beginning the session's transaction as adding an object would (autobegin)."""
        # Session.add() autobegins through this same call; there is no public equivalent
        # that refuses as add() does when the session has autobegin=False.
        transaction = (
            session.get_nested_transaction() or session.get_transaction() or session._autobegin_t()
        )
        state: _Staged[T] | None = session.info.get(self._key)
        if state is None:
            state = session.info[self._key] = _Staged()
        state.buffers.setdefault(transaction, []).append(item)
        if self._write is not None:
            state.unwritten.append(item)

    def staged(self, session: Session) -> int:
        """How many items wait on ``session``'s open transactions."""
        state: _Staged[T] | None = session.info.get(self._key)
        return 0 if state is None else sum(len(items) for items in state.buffers.values())

    # Registered on the Session class for installed engines: every session of the process
    # passes here, so the first test is the cheapest one. Sessions with class or instance
    # listeners of their own are left to those, so nothing runs twice.

    def _session_wide_commit(self, session: Session) -> None:
        if self._key in session.info and not self._listens_on(session):
            self._after_commit(session)

    def _session_wide_end(self, session: Session, transaction: SessionTransaction) -> None:
        if self._key in session.info and not self._listens_on(session):
            self._after_transaction_end(session, transaction)

    def _session_wide_flush(self, session: Session, *_: object) -> None:
        if self._key in session.info and not self._listens_on(session):
            self._flush(session)

    def _flush(self, session: Session, *_: object) -> None:
        """``before_flush`` and ``before_commit``: write what is staged and not written yet,
        in the transaction current now (the writes are kept with it)."""
        state: _Staged[T] | None = session.info.get(self._key)
        if state is None or not state.unwritten or self._write is None:
            return
        items, state.unwritten = state.unwritten, []
        try:
            self._write(session, items)
        except BaseException:
            state.unwritten = items + state.unwritten  # nothing of them is in
            raise
        current = session.get_nested_transaction() or session.get_transaction()
        assert current is not None  # staged items imply an open transaction
        state.written.setdefault(current, []).extend(items)

    def _after_commit(self, session: Session) -> None:
        if self._key in session.info:
            committing = session.get_nested_transaction() or session.get_transaction()
            session.info[self._committing] = committing

    def _after_transaction_end(self, session: Session, transaction: SessionTransaction) -> None:
        info: dict[Any, Any] = session.info
        state: _Staged[T] | None = info.get(self._key)
        if state is None:
            return
        committed = info.get(self._committing) is transaction
        if committed:
            del info[self._committing]
        items = state.buffers.pop(transaction, None)
        written = state.written.pop(transaction, None)
        enclosing = _enclosing(transaction)
        if transaction.parent is None:
            del info[self._key]  # the root ended: nothing may outlive it
        elif committed:
            if written and enclosing is not None:
                state.written.setdefault(enclosing, []).extend(written)
        elif items or written:
            state.rolled_back(items or [], written or [])
        if not items:
            return
        if not committed:
            logger.debug(
                "discarded %d staged message(s): transaction ended without commit",
                len(items),
                extra={"action": "outbox.discarded", "count": len(items)},
            )
        elif enclosing is not None:
            state.buffers.setdefault(enclosing, []).extend(items)  # savepoint released
        else:
            self._hand_off(self._unwritten_left_out(items, state))

    def _unwritten_left_out(self, items: list[T], state: _Staged[T]) -> list[T]:
        """The committed items, less any staged after the commit's last write (by a flush
        hook of the application's): their rows are not in, so they must not be sent."""
        if not state.unwritten:
            return items
        late = {id(item) for item in state.unwritten}
        logger.error(
            "%d message(s) staged during the commit after the outbox wrote its rows were "
            "not written and are not sent: publish before commit() starts",
            len(late),
            extra={"action": "outbox.staged_too_late", "count": len(late)},
        )
        return [item for item in items if id(item) not in late]

    def _hand_off(self, items: list[T]) -> None:
        if not items:
            return
        try:
            self._on_commit(items)
        except Exception:
            logger.exception(
                "handing committed messages to the dispatcher failed; they stay pending",
                extra={"action": "outbox.handoff_failed", "count": len(items)},
            )


class _Staged(Generic[T]):
    """One session's staged items: by the transaction they belong to, those not written yet
    (in staging order), and those written, by the transaction current at their write."""

    __slots__ = ("buffers", "unwritten", "written")

    def __init__(self) -> None:
        self.buffers: dict[SessionTransaction, list[T]] = {}
        self.unwritten: list[T] = []
        self.written: dict[SessionTransaction, list[T]] = {}

    def rolled_back(self, dropped: list[T], undone: list[T]) -> None:
        """A savepoint rolled back: its own items go; the writes it undid of items that
        outlive it (staged outside it) are to be made again, before those not written yet."""
        gone = {id(item) for item in dropped}
        again = [item for item in undone if id(item) not in gone]
        self.unwritten = again + [item for item in self.unwritten if id(item) not in gone]
