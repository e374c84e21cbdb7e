"""``Compensator``: resend outbox rows the dispatcher did not confirm (docs/outbox.md).

Each pass claims due ``pending`` rows in batches (older than ``grace`` on their first
attempt), produces them, and then, fenced by the batch's claim token, marks them ``sent``,
schedules a retry with exponential backoff and jitter, or marks them ``dead``: only a
rejection of the message itself, ``max_attempts`` (if set) used up while the broker is
unavailable, or no queue taking it by ``unroutable_dead_after``. A refusal of the request as
such (401, 403, 404, 405, 415: a configuration error) retries without limit, so fixing the
configuration sends every row. Resends are harmless: the qmq broker and
JetStream deduplicate by message id; on RabbitMQ, which cannot, the consumer's
``IdempotentStore`` drops the second copy (docs/transports.md). Passes run on an
APScheduler ``BackgroundScheduler`` with a fixed delay between them; sent rows older than
``retention`` are purged in small batches.

Keyed rows keep their key's order: a claim takes a keyed row only with every earlier
pending row of its (subject, key) and returns them in id order, which is the order they are
produced in; a failure stops the send, so nothing goes after a row that did not
(``OutboxStore.claim``, docs/outbox.md "Per-key order").

An unreachable database or broker is logged once when it starts failing, summarised every
``config.outage_summary`` while it lasts and logged once when it recovers
(``FailureLog``); while the database is failing, passes back off from ``interval`` up to
``backoff_cap`` (at most ``MAX_OUTAGE_PAUSE``), with jitter.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
import uuid
from datetime import datetime, timedelta
from typing import Unpack

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from qmq_outbox import tracing
from qmq_outbox.backoff import backoff_delay
from qmq_outbox.compensator.config import CompensatorConfig, CompensatorSettings
from qmq_outbox.compensator.metrics import CompensatorMetrics
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.failure_log import client_url, outbox_failures
from qmq_outbox.sending import SendReport, send
from qmq_outbox.store import ClaimedRow, OutboxStore, Retry, utcnow
from qmq_outbox.transports.base import ClosingProducer, Producer, Transport
from qmq_outbox.transports.urls import from_url
from qmq_outbox.unroutable import SubjectWarnings

logger = logging.getLogger("qmq_outbox.compensator")  # the name the docs give its lines

_JOB_ID = "qmq-compensator-pass"
# The pauses between passes while they fail: from max(interval, MIN) up to MAX.
MIN_OUTAGE_PAUSE = timedelta(milliseconds=100)
MAX_OUTAGE_PAUSE = timedelta(seconds=30)


@dataclasses.dataclass(slots=True)
class PassResult:
    """Counts of one compensator pass."""

    claimed: int = 0
    sent: int = 0
    duplicates: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0
    purged: int = 0
    unavailable: int = 0  # batches that found the broker unavailable (or refusing)
    unroutable: int = 0  # rows no queue took (retried, or dead past unroutable_dead_after)

    def add(self, other: PassResult) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class Compensator:
    """Claims and resends unconfirmed outbox rows; run ``start()``/``stop()`` or ``run_once()``.

    ``engine`` is the application's database (the caller owns and disposes it); ``transport``
    (or ``broker_url``, its short form, or an injected producer ``client``) where it sends.
    ``config`` tunes it (a ``CompensatorConfig``); its fields may also be given as keywords
    (``Compensator(engine=e, broker_url=u, batch_size=100)``).
    Several compensators may share a PostgreSQL table; on SQLite run one at a time.
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        store: OutboxStore | None = None,
        client: Producer | None = None,
        transport: Transport | None = None,
        broker_url: str | None = None,
        token: str | None = None,
        config: CompensatorConfig | None = None,
        registry: CollectorRegistry | None = None,
        rng: random.Random | None = None,
        **settings: Unpack[CompensatorSettings],
    ) -> None:
        self._owned_client: ClosingProducer | None = None
        self.config = dataclasses.replace(config or CompensatorConfig(), **settings)
        if store is None:
            if engine is None:
                raise ConfigurationError("Compensator needs engine= (or store=)")
            store = OutboxStore(engine)
        if transport is None and broker_url is not None:
            transport = from_url(broker_url, token=token)
        if client is None:
            if transport is None:
                raise ConfigurationError("Compensator needs transport= or broker_url= (or client=)")
            client = self._owned_client = transport.producer()
        self.transport = transport
        self.store = store
        self.client = client
        self.metrics = CompensatorMetrics(registry)
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._last_purge = float("-inf")
        self._scheduler: BackgroundScheduler | None = None
        self._scheduler_lock = threading.Lock()
        every = self.config.outage_summary.total_seconds()
        database_url = store.engine.url.render_as_string(hide_password=True)
        self._database = outbox_failures(
            "compensator", "database", database_url, logger=logger, summary_interval=every
        )
        self._broker = outbox_failures(
            "compensator", "broker", client_url(client), logger=logger, summary_interval=every
        )
        self._unroutable_log = SubjectWarnings(
            logger=logger, action="outbox.unroutable", interval=every
        )

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    # -- one pass -------------------------------------------------------------------------------

    def run_once(self) -> PassResult:
        """Claim and settle batches until nothing is due, the broker is unavailable, the
        ``pass_budget`` is spent or ``stop()`` was called; then purge if it is time."""
        total = PassResult()
        deadline = time.monotonic() + self.config.pass_budget.total_seconds()
        while not self._stop.is_set():
            result = self.run_batch()
            total.add(result)
            if result.claimed < self.config.batch_size or result.unavailable:
                break
            if time.monotonic() > deadline:
                break
        if time.monotonic() - self._last_purge >= self.config.purge_interval.total_seconds():
            total.purged = self.purge()
            self._last_purge = time.monotonic()
        self.update_gauges()
        return total

    def run_batch(self) -> PassResult:
        """Claim one batch of due rows, produce them and record the outcome."""
        token = str(uuid.uuid4())
        started = time.perf_counter()
        rows = self.store.claim(
            token=token,
            now=utcnow(),
            grace=self.config.grace,
            lease=self.config.lease,
            limit=self.config.batch_size,
        )
        self.metrics.claim_latency.observe(time.perf_counter() - started)
        if not rows:
            return PassResult()
        started = time.perf_counter()
        messages = [row.message for row in rows]
        with tracing.sending("qmq resend", messages) as traced:
            report = traced(send(self.client, messages))
        self.metrics.send_latency.observe(time.perf_counter() - started)
        return self._settle(rows, report, token)

    def _settle(self, rows: list[ClaimedRow], report: SendReport, token: str) -> PassResult:
        by_message = {row.message.id: row for row in rows}
        result = PassResult(claimed=len(rows))
        sent_ids = [by_message[r.id].id for r in report.results]
        marked = self.store.mark_sent(ids=sent_ids, token=token, now=utcnow())
        result.sent = marked
        result.duplicates = sum(1 for r in report.results if r.status == "duplicate")
        result.lost = len(sent_ids) - marked
        for message, error in report.rejected:
            result.dead += self.store.mark_dead(
                ids=[by_message[message.id].id], token=token, error=str(error)
            )
            _log_dead(by_message[message.id], str(error))
        if report.unroutable:
            retried, dead = self._unroutable(report, by_message, token)
            result.unroutable = len(report.unroutable)
            result.retried += retried
            result.dead += dead
        if report.unsent:
            assert report.error is not None
            self._broker.failed(report.error)
            result.unavailable = 1
            unsent = [by_message[m.id] for m in report.unsent]
            # A refused configuration (token, right, URL) is no fault of the rows: never dead.
            limit = self.config.max_attempts if report.configured else None
            retried, dead = self._reschedule(unsent, token, str(report.error), limit)
            result.retried += retried
            result.dead += dead
        elif report.results or report.rejected or report.unroutable:
            self._broker.succeeded()
        self._count(result)
        if result.lost:
            logger.warning(
                "%d sent row(s) had been claimed by another compensator meanwhile",
                result.lost,
                extra={"action": "outbox.claim_lost", "count": result.lost, "token": token},
            )
        if result.sent:
            logger.info(
                "compensator sent %d message(s) (%d already stored)",
                result.sent,
                result.duplicates,
                extra={"action": "outbox.resent", "count": result.sent, "token": token},
            )
        return result

    def _unroutable(
        self, report: SendReport, by_message: dict[str, ClaimedRow], token: str
    ) -> tuple[int, int]:
        """Rows no queue took: retried with backoff until ``unroutable_dead_after``, then
        dead; a warning per subject per ``outage_summary``."""
        now = utcnow()
        limit = self.config.unroutable_dead_after
        retry: list[ClaimedRow] = []
        dead = 0
        subjects: dict[str, tuple[int, str]] = {}
        for message, error in report.unroutable:
            row = by_message[message.id]
            count, _ = subjects.get(message.subject, (0, ""))
            subjects[message.subject] = (count + 1, str(error))
            created = message.created_at
            if created is not None and now - created >= limit:
                reason = f"unroutable for longer than {limit}: {error}"
                dead += self.store.mark_dead(ids=[row.id], token=token, error=reason)
                _log_dead(row, reason)
            else:
                retry.append(row)
        for subject, (count, reason) in subjects.items():
            self._unroutable_log.note(
                subject, count, reason, f"retrying with backoff, dead after {limit}"
            )
        retried, _ = self._reschedule(retry, token, str(report.unroutable[0][1]), None)
        return retried, dead

    def _reschedule(
        self, rows: list[ClaimedRow], token: str, error: str, max_attempts: int | None
    ) -> tuple[int, int]:
        """Retry ``rows`` after their backoff; those past ``max_attempts`` (None: no limit)
        are marked dead instead."""
        limit = max_attempts if max_attempts is not None else float("inf")
        out_of_attempts = [row for row in rows if row.attempts >= limit]
        retries = self._retries([row for row in rows if row.attempts < limit])
        self.store.mark_retry(retries=retries, token=token, error=error)
        dead = self.store.mark_dead(ids=[r.id for r in out_of_attempts], token=token, error=error)
        for row in out_of_attempts:
            _log_dead(row, error)
        if retries:  # the outage itself is logged by self._broker
            logger.debug(
                "%d row(s) rescheduled: %s",
                len(retries),
                error,
                extra={"action": "outbox.retry_scheduled", "count": len(retries)},
            )
        return len(retries), dead

    def _retries(self, rows: list[ClaimedRow]) -> list[Retry]:
        """Each row's next attempt after its backoff; a key's rows (in id order) never
        before an earlier one of theirs, so the claim finds them due together."""
        now = utcnow()
        retries: list[Retry] = []
        key_due: dict[tuple[str, str], datetime] = {}
        for row in sorted(rows, key=lambda r: r.id):
            due = now + self._delay(row.attempts)
            if row.message.key is not None:
                order_key = (row.message.subject, row.message.key)
                due = key_due[order_key] = max(due, key_due.get(order_key, due))
            retries.append(Retry(id=row.id, next_attempt_at=due))
        return retries

    def _delay(self, attempts: int) -> timedelta:
        return backoff_delay(
            attempts, base=self.config.backoff_base, cap=self.config.backoff_cap, rng=self._rng
        )

    def _count(self, result: PassResult) -> None:
        self.metrics.sent.inc(result.sent)
        self.metrics.resent.inc(min(result.duplicates, result.sent))
        self.metrics.retried.inc(result.retried)
        self.metrics.dead.inc(result.dead)
        self.metrics.lost_claims.inc(result.lost)

    def purge(self, *, now: datetime | None = None, max_batches: int = 100) -> int:
        """Delete sent rows older than the retention, ``purge_batch_size`` at a time."""
        before = (now or utcnow()) - self.config.retention
        purged = 0
        for _ in range(max_batches):
            if self._stop.is_set():
                break
            deleted = self.store.purge_sent(before=before, batch_size=self.config.purge_batch_size)
            purged += deleted
            if deleted < self.config.purge_batch_size:
                break
        self.metrics.purged.inc(purged)
        if purged:
            logger.info(
                "purged %d sent row(s)", purged, extra={"action": "outbox.purged", "count": purged}
            )
        return purged

    def update_gauges(self) -> None:
        self.metrics.refresh(self.store.backlog(), utcnow())

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Run passes in the background, ``interval`` apart, the first one now."""
        if self._scheduler is not None:
            raise ConfigurationError("compensator already started")
        self._stop.clear()
        executor = ThreadPoolExecutor(1, pool_kwargs={"thread_name_prefix": self.config.name})
        self._scheduler = BackgroundScheduler(executors={"default": executor}, timezone="UTC")
        self._scheduler.start()
        thread = getattr(self._scheduler, "_thread", None)
        if thread is not None:
            thread.name = f"{self.config.name}-scheduler"
        self._schedule(delay=timedelta(0))
        logger.info("compensator started", extra={"action": "outbox.compensator_started"})

    def _schedule(self, *, delay: timedelta) -> None:
        with self._scheduler_lock:
            if self._scheduler is None or self._stop.is_set():
                return
            self._scheduler.add_job(
                self._job,
                "date",
                run_date=utcnow() + delay,
                id=_JOB_ID,
                replace_existing=True,
                misfire_grace_time=None,
            )

    def _job(self) -> None:
        self._idle.clear()
        try:
            self.run_once()
        except Exception as exc:  # an unexpected one gets its traceback once, in FailureLog
            self._database.failed(exc)
        except BaseException:
            logger.critical(
                "compensator pass crashed",
                exc_info=True,
                extra={"action": "outbox.compensator_crashed"},
            )
            raise
        else:
            self._database.succeeded()
        finally:
            self._idle.set()
            self._schedule(delay=self._pause())

    def _pause(self) -> timedelta:
        """``interval``, or while passes fail a backoff from it (jittered, capped)."""
        interval = self.config.interval
        failures = self._database.failures
        if not failures:
            return interval
        base = max(interval, MIN_OUTAGE_PAUSE)
        cap = max(base, min(self.config.backoff_cap, MAX_OUTAGE_PAUSE))
        return max(interval, backoff_delay(failures, base=base, cap=cap, rng=self._rng))

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop after the current batch; True if it finished within ``timeout`` seconds."""
        self._stop.set()
        with self._scheduler_lock:
            scheduler, self._scheduler = self._scheduler, None
            if scheduler is not None:
                scheduler.shutdown(wait=False)
        finished = self._idle.wait(timeout)
        if self._owned_client is not None and finished:
            self._owned_client.close()
        logger.info(
            "compensator stopped",
            extra={"action": "outbox.compensator_stopped", "clean": finished},
        )
        return finished


def _log_dead(row: ClaimedRow, error: str) -> None:
    logger.error(
        "outbox message %s of subject %s is dead after %d attempt(s): %s",
        row.message.id,
        row.message.subject,
        row.attempts,
        error,
        extra={"action": "outbox.dead", "message_id": row.message.id, "attempts": row.attempts},
    )
