"""``Dispatch``: the dispatcher's state and decisions, without I/O (nor knowledge of the
transport); the drivers (``threads``, ``aio``) run it. Its breaker keeps senders off a
failing broker for a while, jittered, longer after each failure in a row."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Engine

from qmq_outbox.backoff import backoff_seconds
from qmq_outbox.dispatcher.logs import log_held, log_report, log_skipped, logger
from qmq_outbox.dispatcher.queues import Backlog, Batch, Keyed, KeyLanes, Send, by_engine
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import QmqError
from qmq_outbox.failure_log import DEFAULT_SUMMARY_INTERVAL, FailureLog, outbox_failures
from qmq_outbox.sending import SendReport
from qmq_outbox.store import OrderCheck, utcnow
from qmq_outbox.unroutable import SubjectWarnings

HOLD_DELAY = 0.02
MAX_HOLDS = 6  # 20 ms doubling: about 1.3 s in all before the compensator takes over


class _Breaker:
    """After a failure, skip sending for a while (rows wait for the compensator): about
    ``cooldown`` seconds, doubling with each failure in a row up to ``max_cooldown``."""

    def __init__(self, cooldown: float, max_cooldown: float) -> None:
        self.cooldown = cooldown
        self.max_cooldown = max(cooldown, max_cooldown)
        self._open_until = 0.0

    def allows(self) -> bool:
        return time.monotonic() >= self._open_until

    def remaining(self) -> float:
        """Seconds until it closes again (0 when it is closed)."""
        return max(0.0, self._open_until - time.monotonic())

    def open(self, failures: int) -> None:
        pause = backoff_seconds(failures, base=self.cooldown, cap=self.max_cooldown)
        self._open_until = time.monotonic() + max(pause, self.cooldown)


class Dispatch:
    """The dispatcher's state and decisions; the drivers guard it (a lock, or one loop).

    ``broker`` follows the broker's outages (``target`` is its URL) and ``databases`` those
    of each engine's database. ``lanes``: one per sender, for keyed messages; a held-back
    keyed message is tried again after ``hold_delay`` seconds, doubling, ``max_holds`` times.
    ``retry_for``: how long after its publish a message the broker could not take is kept
    for another try (0: left to the compensator at once, and nothing is queued while the
    breaker is open).
    """

    def __init__(
        self,
        *,
        capacity: int,
        batch_size: int,
        cooldown: float,
        max_cooldown: float = 15.0,
        target: str = "broker",
        outage_summary_interval: float = DEFAULT_SUMMARY_INTERVAL,
        lanes: int = 1,
        hold_delay: float = HOLD_DELAY,
        max_holds: int = MAX_HOLDS,
        retry_for: float = 0.0,
    ) -> None:
        self.backlog = Backlog(capacity)
        self.retry_for = retry_for
        self.keyed = KeyLanes(lanes)
        self.batch_size = batch_size
        self.hold_delay = hold_delay
        self.max_holds = max_holds
        self.breaker = _Breaker(cooldown, max_cooldown)
        self.closing = False
        self.summary_interval = outage_summary_interval
        self.broker = outbox_failures(
            "dispatcher", "broker", target, logger=logger, summary_interval=outage_summary_interval
        )
        self.unroutable = SubjectWarnings(
            logger=logger, action="outbox.unroutable", interval=outage_summary_interval
        )
        self.databases: dict[str, FailureLog] = {}

    @property
    def cooling_down(self) -> bool:
        """A send failed moments ago: sends wait (or, without ``retry_for``, messages are
        left to the compensator for now)."""
        return not self.breaker.allows()

    @property
    def queued(self) -> int:
        return len(self.backlog) + len(self.keyed)

    def offer(self, engine: Engine, messages: Sequence[OutgoingMessage]) -> bool:
        """Queue committed messages; False (rows stay pending) if full or closed, or cooling
        down without ``retry_for``."""
        if self.closing or (not self.retry_for and not self.breaker.allows()):
            return False
        if self.queued + len(messages) > self.backlog.capacity:
            return False
        self.backlog.offer(engine, [m for m in messages if m.key is None])
        self.keyed.add(engine, [m for m in messages if m.key is not None])
        return True

    def take(self, lane: int = 0, now: float | None = None) -> Batch:
        """Lane ``lane``'s next batch: its due keyed messages and unkeyed ones, each kind
        getting at least half of ``batch_size`` when both wait."""
        now = time.monotonic() if now is None else now
        if not self.breaker.allows():  # wait for it to close; give up when closing
            if self.closing:
                self._give_up("broker unavailable at close")
            return Batch(lane)
        if self.broker.failing and self.retry_for:
            self._expire()
        keyed_room = self.batch_size - min(len(self.backlog), self.batch_size // 2)
        keyed = self.keyed.take(lane, keyed_room, now)
        return Batch(lane, self.backlog.take(self.batch_size - len(keyed)), keyed)

    def _expire(self) -> None:
        """Leave to the compensator what is too old for the dispatcher to send safely."""
        oldest = utcnow() - timedelta(seconds=self.retry_for)

        def young(message: OutgoingMessage) -> bool:
            return message.created_at is None or message.created_at >= oldest

        dropped = self.backlog.drop(young) + self.keyed.drop(young)
        if dropped:
            log_skipped(dropped, f"broker unavailable for over {self.retry_for:g}s")

    def _give_up(self, why: str) -> None:
        dropped = self.backlog.clear() + self.keyed.drop(lambda message: False)
        if dropped:
            log_skipped(dropped, why)

    def requeue(self, lane: int, engine: Engine, messages: Sequence[OutgoingMessage]) -> None:
        """Keep a failed send's messages for the next try (with ``retry_for``, until closing),
        ahead of the rest: they are older."""
        if not messages or not self.retry_for or self.closing:
            return
        self.backlog.put_back(engine, [m for m in messages if m.key is None])
        keyed = [Keyed(engine, m) for m in messages if m.key is not None]
        if keyed:
            self.keyed.put_back(lane, keyed)

    def drained(self, lane: int) -> bool:
        """Nothing left for lane ``lane``'s sender."""
        return not self.backlog and self.keyed.is_empty(lane)

    def wait_time(self, lane: int, now: float) -> float | None:
        """Seconds until lane ``lane`` may send again (its next held message is due, or the
        breaker closes while messages wait); None if nothing waits."""
        waits: list[float] = []
        due = self.keyed.next_due(lane, now)
        if due is not None:
            waits.append(due - now)
        if not self.breaker.allows() and not self.drained(lane):
            waits.append(self.breaker.remaining())
        return min(waits, default=None)

    def sends(self, batch: Batch) -> Iterator[Send]:
        """The batch's messages by engine, as long as the broker is not cooling down."""
        for part in by_engine(batch):
            if self.breaker.allows():
                yield part
            elif self.retry_for and not self.closing:
                self.requeue(batch.lane, part.engine, part.plain)
                self.keyed.put_back(batch.lane, part.keyed)
            else:
                log_skipped(len(part.plain) + len(part.keyed), "broker recently unavailable")

    def ordered(
        self, lane: int, engine: Engine, keyed: list[Keyed], check: OrderCheck | QmqError
    ) -> list[OutgoingMessage]:
        """The keyed messages that may go now, in outbox id order. Held-back ones go back
        to the lane for another try (the compensator's after ``max_holds``); those already
        sent or dead are dropped; all of them, if the check itself failed."""
        if isinstance(check, QmqError):
            self._database(engine).failed(check)
            return []
        ready = [entry for entry in keyed if entry.message.id in check.sendable]
        ready.sort(key=lambda entry: check.sendable[entry.message.id])
        held = [entry for entry in keyed if entry.message.id in check.held]
        if held:
            self._hold(lane, held)
        return [entry.message for entry in ready]

    def _hold(self, lane: int, held: list[Keyed]) -> None:
        now = time.monotonic()
        again: list[Keyed] = []
        for entry in held:
            entry.holds += 1
            if entry.holds <= self.max_holds:
                entry.due = now + self.hold_delay * 2 ** (entry.holds - 1)
                again.append(entry)
        self.keyed.put_back(lane, again)
        log_held(len(held), len(held) - len(again))

    def completion(self, report: SendReport) -> dict[str, Any]:
        """Learn from a send (a failure opens the breaker); the store's ``mark_dispatched``
        arguments for its rows: sent ones, and rejected ones dead. Unroutable ones stay
        pending for the compensator."""
        if report.error is not None:
            self.breaker.open(self.broker.failed(report.error))
        elif report.results or report.rejected or report.unroutable:
            self.broker.succeeded()
        for subject, count, reason in _by_subject(report):
            self.unroutable.note(subject, count, reason, "left to the compensator")
        return {
            "sent_ids": [r.id for r in report.results],
            "dead": [(message.id, str(error)) for message, error in report.rejected],
            "now": utcnow(),
        }

    def settled(self, engine: Engine, report: SendReport, marked: int | QmqError) -> None:
        """Log a send and how marking its rows went (a failure leaves them to the
        compensator, whose resend the broker deduplicates)."""
        database = self._database(engine)
        if isinstance(marked, QmqError):
            database.failed(marked)
            logger.debug(
                "could not mark rows; the compensator will resend (deduplicated)",
                extra={"action": "outbox.mark_failed", "count": _count(report)},
            )
            marked = 0
        else:
            database.succeeded()
        log_report(report, marked)

    def _database(self, engine: Engine) -> FailureLog:
        target = engine.url.render_as_string(hide_password=True)
        log = self.databases.get(target)
        if log is None:  # setdefault: two sender threads may get here at once
            log = self.databases.setdefault(
                target,
                outbox_failures(
                    "dispatcher",
                    "database",
                    target,
                    logger=logger,
                    summary_interval=self.summary_interval,
                ),
            )
        return log


def _by_subject(report: SendReport) -> list[tuple[str, int, str]]:
    found: dict[str, tuple[int, str]] = {}
    for message, error in report.unroutable:
        count, _ = found.get(message.subject, (0, ""))
        found[message.subject] = (count + 1, str(error))
    return [(subject, count, reason) for subject, (count, reason) in found.items()]


def _count(report: SendReport) -> int:
    return len(report.results) + len(report.rejected) + len(report.unsent)
