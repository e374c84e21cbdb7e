"""How background loops log a dependency that is down: once, a summary now and then, once more.

A loop that retries a database or a broker every second would otherwise write a line (or a
traceback) per attempt. ``FailureLog`` follows one dependency of one loop and writes:

- one line when it starts failing (a traceback only for an unexpected exception, once per
  exception type);
- a summary with the failure count every ``summary_interval`` seconds while it lasts;
- one line when it recovers ("... recovered after 37 s, 812 failures").

Every line names the dependency's URL (its password masked) and the last error. Several
*sources* (a consumer's pullers and its acker) may share one log: the outage starts with the
first failing source and ends when none is failing. Thread-safe; the clock is injectable.

``RepeatedFailures`` does the same for failures that come between successes (a consumer
group's handler failing on some messages): the first few lines in full, then one summary
per interval, until the failures stop for an interval. A database error is written as its
class and the database's one-line message, never its SQL (that goes to DEBUG).

Both (and ``unroutable.SubjectWarnings``) stand on ``IntervalLog``: the logger, the action
key, the fields and the summary interval on one clock.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict, Unpack

from qmq_outbox.dburl import mask_url
from qmq_outbox.envelope import Message
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable, OutboxStoreError

DEFAULT_SUMMARY_INTERVAL = 60.0
MAX_ERROR_CHARS = 500
_CATALOGUE_LINK = re.compile(r"\(Background on this error at: \S+\)")
_OUTBOX_DOWN: dict[str, tuple[type[BaseException], ...]] = {
    "database": (OutboxStoreError,),
    "broker": (BrokerUnavailable, BrokerRejected),
}


class IntervalOptions(TypedDict, total=False):
    """``IntervalLog``'s options, which its subclasses pass on as given."""

    summary_interval: float
    fields: Mapping[str, Any] | None
    clock: Callable[[], float]


class IntervalLog:
    """What the lines of a repeated event share: the logger, the ``action`` key, ``fields``
    for every line's ``extra``, and the interval between summaries on an injectable clock.
    Subclasses keep their counts under ``_lock`` (thread-safe)."""

    def __init__(
        self,
        *,
        logger: logging.Logger,
        action: str,
        summary_interval: float = DEFAULT_SUMMARY_INTERVAL,
        fields: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.summary_interval = summary_interval
        self._logger = logger
        self._action = action
        self._fields = dict(fields or {})
        self._clock = clock
        self._lock = threading.Lock()

    def _due(self, since: float, now: float) -> bool:
        """Whether a summary interval has passed from ``since`` to ``now``."""
        return now - since >= self.summary_interval


class FailureLog(IntervalLog):
    """The outage state of one dependency (``what`` at ``target``) and the lines it writes.

    ``action`` prefixes the lines' ``action`` key: ``<action>.failing``, ``.still_failing``
    and ``.recovered``. ``expected`` are the exception types that mean "down" (no traceback).
    ``fields`` go into every line's ``extra`` (a consumer's group, say); it, ``summary_interval``
    and ``clock`` are ``IntervalOptions``.
    """

    def __init__(
        self,
        *,
        what: str,
        target: str,
        action: str,
        logger: logging.Logger,
        expected: tuple[type[BaseException], ...] = (),
        **options: Unpack[IntervalOptions],
    ) -> None:
        super().__init__(logger=logger, action=action, **options)
        self.what = what
        self.target = target
        self._expected = expected
        self._failing: dict[str, int] = {}  # source -> failures in a row
        self._since = 0.0
        self._reported_at = 0.0
        self._count = 0
        self._traced: set[type[BaseException]] = set()

    @property
    def failing(self) -> bool:
        return bool(self._failing)

    @property
    def failures(self) -> int:
        """Failures since the outage started (0 when not failing)."""
        return self._count

    def failed(self, error: BaseException, *, source: str = "") -> int:
        """Count a failure; returns how many times in a row ``source`` has now failed."""
        unexpected = not isinstance(error, self._expected)
        text = describe(error, with_type=unexpected)
        with self._lock:
            now = self._clock()
            starting = not self._failing
            if starting:
                self._since = self._reported_at = now
                self._count = 0
                self._traced.clear()
            in_a_row = self._failing[source] = self._failing.get(source, 0) + 1
            self._count += 1
            trace = unexpected and type(error) not in self._traced
            if trace:
                self._traced.add(type(error))
            summary = not starting and self._due(self._reported_at, now)
            if summary:
                self._reported_at = now
            count, down_for = self._count, now - self._since
        if starting or trace:
            self._log_failing(error, text, source, trace)
        elif summary:
            self._log_summary(count, down_for, text)
        return in_a_row

    def succeeded(self, *, source: str = "") -> None:
        """``source`` worked; when no source is failing any more, the outage is over."""
        if not self._failing:  # the usual case, without the lock
            return
        with self._lock:
            if self._failing.pop(source, None) is None or self._failing:
                return
            count, down_for = self._count, self._clock() - self._since
            self._count = 0
        self._log(
            "%s %s recovered after %s, %d failure(s)",
            (self.what, self.target, seconds(down_for), count),
            "recovered",
            {"failures": count, "down_for": round(down_for, 3)},
        )

    def _log_failing(self, error: BaseException, text: str, source: str, trace: bool) -> None:
        where = f" ({source})" if source else ""
        if sql_error(error) is not None:  # its traceback would print the statement
            self._logger.debug("%s: %s", self.what, error, exc_info=error)
            trace = False
        self._log(
            "%s %s failing%s: %s; retrying with backoff",
            (self.what, self.target, where, text),
            "failing",
            {"error": text, "source": source},
            level=logging.ERROR if trace else logging.WARNING,
            exc_info=error if trace else None,
        )

    def _log_summary(self, count: int, down_for: float, text: str) -> None:
        self._log(
            "%s %s still failing after %s: %d failure(s); last error: %s",
            (self.what, self.target, seconds(down_for), count, text),
            "still_failing",
            {"error": text, "failures": count, "down_for": round(down_for, 3)},
        )

    def _log(
        self,
        message: str,
        args: tuple[object, ...],
        state: str,
        extra: dict[str, Any],
        *,
        level: int = logging.WARNING,
        exc_info: BaseException | None = None,
    ) -> None:
        extra = {**self._fields, **extra, "action": f"{self._action}.{state}"}
        extra["target"] = self.target
        self._logger.log(level, message, *args, exc_info=exc_info, extra=extra)


def outbox_failures(
    loop: Literal["dispatcher", "compensator"],
    dependency: Literal["database", "broker"],
    target: str,
    *,
    logger: logging.Logger,
    summary_interval: float,
) -> FailureLog:
    """The outages of ``dependency`` as an outbox loop sees them: lines named
    "<loop>: <dependency>", actions ``outbox.<loop>.<dependency>.*``. The broker is down
    when it is unavailable or refuses the request; the database, on a store error."""
    return FailureLog(
        what=f"{loop}: {dependency}",
        target=target,
        action=f"outbox.{loop}.{dependency}",
        logger=logger,
        expected=_OUTBOX_DOWN[dependency],
        summary_interval=summary_interval,
    )


class RepeatedFailures(IntervalLog):
    """Failures of one kind that come between successes, as a few lines and then summaries.

    The first ``first_lines`` failures get a line each (with the traceback, unless it would
    print SQL); after that one summary every ``summary_interval`` seconds with the count and
    the last failure. A quiet interval (no failure) starts over. ``flush()`` writes a summary
    still owed (at a stop). Lines read "<what> failed on <detail>: <error>".
    """

    def __init__(
        self,
        *,
        what: str,
        action: str,
        logger: logging.Logger,
        first_lines: int = 5,
        **options: Unpack[IntervalOptions],
    ) -> None:
        super().__init__(logger=logger, action=action, **options)
        self.what = what
        self.first_lines = first_lines
        self._shown = 0
        self._last_at: float | None = None
        self._window_at = 0.0
        self._held = 0  # failures since the last line
        self._last = ("", "")  # the last held failure: detail, error

    def failed(
        self, detail: str, error: BaseException, *, extra: Mapping[str, Any] | None = None
    ) -> None:
        """Count one failure; ``detail`` names it ("subject s, message m, seq 3, attempt 1")."""
        text = describe(error, with_type=True)
        with self._lock:
            now = self._clock()
            owed = None
            if self._last_at is not None and self._due(self._last_at, now):
                owed = self._take_summary(now)  # quiet for an interval: start over
                self._shown = 0
            self._last_at = now
            full = self._shown < self.first_lines
            if full:
                self._shown += 1
                self._window_at = now
                last_full = self._shown == self.first_lines
            else:
                self._held += 1
                self._last = (detail, text)
                due = self._due(self._window_at, now)
                summary = self._take_summary(now) if due else None
        if owed is not None:
            self._log_summary(*owed)
        if full:
            self._log_failure(detail, text, error, dict(extra or {}), last_full)
        elif summary is not None:
            self._log_summary(*summary)

    def flush(self) -> None:
        """Write the summary of failures not yet reported, if any."""
        with self._lock:
            owed = self._take_summary(self._clock())
        if owed is not None:
            self._log_summary(*owed)

    def _take_summary(self, now: float) -> tuple[int, float, str, str] | None:
        if not self._held:
            return None
        summary = (self._held, now - self._window_at, *self._last)
        self._held, self._window_at = 0, now
        return summary

    def _log_failure(
        self, detail: str, text: str, error: BaseException, extra: dict[str, Any], last: bool
    ) -> None:
        more = (
            f"; further failures are summarised every {seconds(self.summary_interval)}"
            if last
            else ""
        )
        hides_sql = sql_error(error) is not None
        if hides_sql:
            self._logger.debug("%s failed on %s: %s", self.what, detail, error, exc_info=error)
        self._logger.warning(
            "%s failed on %s: %s%s",
            self.what,
            detail,
            text,
            more,
            exc_info=None if hides_sql else error,
            extra={**self._fields, **extra, "action": self._action, "error": text},
        )

    def _log_summary(self, count: int, span: float, detail: str, text: str) -> None:
        self._logger.warning(
            "%s failed %d more time(s) in %s; the last on %s: %s",
            self.what,
            count,
            seconds(span),
            detail,
            text,
            extra={
                **self._fields,
                "action": f"{self._action}.summary",
                "failures": count,
                "error": text,
            },
        )


def describe(error: BaseException, *, with_type: bool = False) -> str:
    """``error`` on one line, at most ``MAX_ERROR_CHARS`` long (driver errors span several).

    A SQLAlchemy statement error in it (or in its cause) is cut to its class and the
    database's first line: no SQL, no parameters, no link to SQLAlchemy's catalogue."""
    text = str(error)
    sql = sql_error(error)
    if sql is not None:
        text = text.replace(str(sql), _sql_summary(sql)) if sql is not error else ""
        text = text or _sql_summary(sql)
    text = " ".join(_CATALOGUE_LINK.sub("", text).split()) or type(error).__name__
    if with_type and not text.startswith(type(error).__name__):
        text = f"{type(error).__name__}: {text}"
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return text


def delivery(message: Message) -> str:
    """A delivered message as a failure line names it."""
    return (
        f"subject {message.subject}, message {message.id}, seq {message.seq}, "
        f"attempt {message.attempt}"
    )


def sql_error(error: BaseException) -> BaseException | None:
    """The SQLAlchemy statement error (one with a ``statement``) in ``error``'s chain."""
    seen: BaseException | None = error
    for _ in range(8):  # a chain is short; a cycle is not followed
        if seen is None:
            return None
        if hasattr(seen, "statement") and hasattr(seen, "orig"):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _sql_summary(error: BaseException) -> str:
    orig = getattr(error, "orig", None)
    first = (str(orig) if orig is not None else str(error)).strip().splitlines()
    line = first[0] if first else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def seconds(value: float) -> str:
    """A duration for a log line: "0.4 s", "37 s"."""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def client_url(client: object) -> str:
    """The URL a broker client talks to (its ``base_url``), for log lines; the class name
    of a client without one."""
    base = getattr(client, "base_url", None)
    return mask_url(str(base)) if base else type(client).__name__
