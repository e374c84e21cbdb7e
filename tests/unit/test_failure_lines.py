"""Failure lines a person can read (issue 36 item 8).

A handler failure names subject, group, message id, seq and attempt in its text (what
``logging.basicConfig`` shows); a group failing over and over writes a few lines and then
summaries; a database error is its class and the database's one line, the SQL at DEBUG.
"""

from __future__ import annotations

import logging
import threading

import psycopg
import pytest
import sqlalchemy as sa

from qmq_outbox import Consumer, Message, OutgoingMessage
from qmq_outbox.consumer.logs import HANDLER_FAILURE_LINES
from qmq_outbox.errors import OutboxStoreError
from qmq_outbox.failure_log import FailureLog, RepeatedFailures, describe
from qmq_outbox.testing import InMemoryBroker
from tests.support.waiting import wait_until

SUBJECT = "order.created"
SQL = "SELECT qmq_outbox.id, qmq_outbox.message_id FROM qmq_outbox WHERE status = %(s)s"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if str(getattr(r, "action", "")).startswith(action)]


def missing_table() -> sa.exc.ProgrammingError:
    """What SQLAlchemy raises for a missing table, with its statement and parameters."""
    orig = psycopg.errors.UndefinedTable(
        'relation "qmq_outbox" does not exist\nLINE 1: SELECT qmq_outbox.id FROM qmq_outbox\n'
    )
    return sa.exc.ProgrammingError(SQL, {"s": "pending"}, orig)


def test_a_consumers_failing_group_names_each_message_then_summarises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = InMemoryBroker()
    with broker.client() as client:
        client.produce(
            [OutgoingMessage(id=f"m-{n}", subject=SUBJECT, body=b"{}") for n in range(100)]
        )
    failed = threading.Semaphore(0)
    calls: list[int] = []

    def handler(message: Message) -> None:
        calls.append(message.seq)
        failed.release()
        raise ValueError(f"no customer for seq {message.seq}")

    client = broker.client()
    consumer = Consumer(
        "http://unused", "billing", client=client, consumer_id="c1", wait_ms=50, prefetch=100
    )
    consumer.add_handler(SUBJECT, handler)
    caplog.set_level(logging.INFO, logger="qmq_outbox")
    thread = threading.Thread(target=consumer.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        wait_until(lambda: len(calls) >= 100, timeout=20)
    finally:
        consumer.stop()
        thread.join(10)
        client.close()
    lines = records(caplog, "consumer.handler_failed")
    full = [r for r in lines if r.action == "consumer.handler_failed"]  # type: ignore[attr-defined]
    summaries = [r for r in lines if r.action.endswith(".summary")]  # type: ignore[attr-defined]
    assert len(full) == HANDLER_FAILURE_LINES
    assert len(summaries) == 1  # the rest, flushed at the stop (no interval went by)
    first = full[0]
    seq = calls[0]
    assert first.getMessage().startswith(
        f"consumer group billing: handler failed on subject {SUBJECT}, message m-{seq}, "
        f"seq {seq}, attempt 1: ValueError: no customer for seq {seq}"
    )
    assert first.exc_info is not None  # the traceback, for the first lines
    assert "further failures are summarised every 60 s" in full[-1].getMessage()
    text = summaries[0].getMessage()
    assert text.startswith(f"consumer group billing: handler failed {len(calls) - len(full)} more")
    assert f"the last on subject {SUBJECT}, message m-" in text
    assert summaries[0].exc_info is None


def test_many_failures_in_a_short_time_are_at_most_n_lines_and_a_summary_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    logger = logging.getLogger("test.failure_lines")
    failures = RepeatedFailures(
        what="consumer group g: handler", action="t.failed", logger=logger,
        first_lines=3, summary_interval=5.0, clock=clock,
    )  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="test.failure_lines")
    for n in range(100):  # 100 failures in 20 s
        clock.now = n * 0.2
        failures.failed(f"subject s, message m-{n}, seq {n}, attempt 1", RuntimeError("boom"))
    lines = records(caplog, "t.failed")
    assert len(lines) <= 3 + 20 / 5
    assert [r.action for r in lines[:3]] == ["t.failed"] * 3  # type: ignore[attr-defined]
    counts = [r.failures for r in lines[3:]]  # type: ignore[attr-defined]
    failures.flush()
    counts.append(records(caplog, "t.failed")[-1].failures)  # type: ignore[attr-defined]
    assert sum(counts) == 97  # every failure counted in some summary
    assert "the last on subject s, message m-99, seq 99" in caplog.records[-1].getMessage()

    caplog.clear()
    clock.now += 5.0  # a quiet interval: the next failure is news again
    failures.failed("subject s, message m-100, seq 100, attempt 2", RuntimeError("boom"))
    assert [r.action for r in caplog.records] == ["t.failed"]  # type: ignore[attr-defined]


def test_a_database_error_is_one_line_without_sql() -> None:
    error = missing_table()
    assert describe(error) == 'ProgrammingError: relation "qmq_outbox" does not exist'
    wrapped = OutboxStoreError(f"outbox claim failed: {error}")
    wrapped.__cause__ = error
    assert describe(wrapped) == (
        'outbox claim failed: ProgrammingError: relation "qmq_outbox" does not exist'
    )


def test_a_missing_table_is_logged_without_its_sql_at_error_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="test.failure_lines")
    log = FailureLog(
        what="compensator: database",
        target="postgresql://app@db/app",
        action="t.database",
        logger=logging.getLogger("test.failure_lines"),
    )
    log.failed(missing_table())  # not an expected type: would have had its traceback
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1
    assert loud[0].exc_info is None
    assert "SELECT" not in loud[0].getMessage()
    assert 'ProgrammingError: relation "qmq_outbox" does not exist' in loud[0].getMessage()
    assert len(loud[0].getMessage()) < 200
    quiet = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert quiet
    assert "SELECT" in quiet[0].getMessage()  # the whole of it, for whoever turns DEBUG on


def test_sql_handler_failures_keep_their_traceback_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="test.failure_lines")
    failures = RepeatedFailures(
        what="consumer group g: handler",
        action="t.failed",
        logger=logging.getLogger("test.failure_lines"),
    )
    failures.failed("subject s, message m, seq 1, attempt 1", missing_table())
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.exc_info is None
    assert "SELECT" not in warning.getMessage()
    (debug,) = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert debug.exc_info is not None
