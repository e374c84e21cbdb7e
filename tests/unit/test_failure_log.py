"""The outage log policy (``FailureLog``) with a fake clock, the dispatcher's use of it, and
the backoff it goes with: pure logic, no I/O."""

from __future__ import annotations

import logging
import random
from datetime import timedelta

import pytest

from qmq_outbox.backoff import backoff_delay, backoff_seconds
from qmq_outbox.client import BrokerClient
from qmq_outbox.dburl import mask_url
from qmq_outbox.dispatcher import Dispatch
from qmq_outbox.envelope import ProduceResult
from qmq_outbox.errors import BrokerUnavailable, OutboxStoreError
from qmq_outbox.failure_log import FailureLog, client_url, describe
from qmq_outbox.sending import SendReport

TARGET = "postgresql+psycopg://app:***@db:5432/app"
log = logging.getLogger("tests.failure_log")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)


def failure_log(clock: FakeClock, **options: object) -> FailureLog:
    settings: dict[str, object] = {
        "what": "compensator: database",
        "target": TARGET,
        "action": "test.database",
        "logger": log,
        "expected": (OutboxStoreError,),
        "summary_interval": 60.0,
        "clock": clock,
    }
    settings.update(options)
    return FailureLog(**settings)  # type: ignore[arg-type]


def down() -> OutboxStoreError:
    return OutboxStoreError(
        "outbox claim failed: (psycopg.OperationalError) connection refused\n"
        "\tIs the server running on that host?"
    )


def test_an_outage_is_one_line_then_a_summary_a_minute_then_one_line(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    failures = failure_log(clock)
    failures.succeeded()  # healthy: nothing to say
    assert caplog.records == []

    for _ in range(60):  # a failure a second for a minute: one line
        failures.failed(down())
        clock.now += 1
    assert len(caplog.records) == 1
    (first,) = caplog.records
    assert first.levelno == logging.WARNING
    assert first.exc_info is None
    assert first.getMessage() == (
        f"compensator: database {TARGET} failing: outbox claim failed: "
        "(psycopg.OperationalError) connection refused Is the server running on that host?"
        "; retrying with backoff"
    )
    assert first.__dict__["action"] == "test.database.failing"
    assert first.__dict__["target"] == TARGET

    for _ in range(752):  # the summaries come a minute apart, whatever the rate
        failures.failed(down())
        clock.now += 0.05
    summaries = caplog.records[1:]
    assert [r.__dict__["action"] for r in summaries] == ["test.database.still_failing"]
    assert (
        summaries[0]
        .getMessage()
        .startswith(
            f"compensator: database {TARGET} still failing after 60 s: 61 failure(s); last error: "
        )
    )

    clock.now += 0.4
    failures.succeeded()
    recovered = caplog.records[-1]
    assert recovered.getMessage() == (
        f"compensator: database {TARGET} recovered after 98 s, 812 failure(s)"
    )
    assert recovered.__dict__["failures"] == 812
    assert len(caplog.records) == 3
    assert not failures.failing
    assert failures.failures == 0

    failures.succeeded()
    failures.failed(down())  # a new outage starts afresh
    assert len(caplog.records) == 4
    assert caplog.records[-1].__dict__["action"] == "test.database.failing"


def test_an_unexpected_exception_gets_its_traceback_once_per_type(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    failures = failure_log(clock)
    failures.failed(down())
    for _ in range(3):
        failures.failed(KeyError("row"))
    failures.failed(ValueError("bad"))
    assert [(r.levelno, r.exc_info is not None) for r in caplog.records] == [
        (logging.WARNING, False),
        (logging.ERROR, True),
        (logging.ERROR, True),
    ]
    assert "failing: KeyError: 'row'" in caplog.records[1].getMessage()
    assert "failing: ValueError: bad" in caplog.records[2].getMessage()


def test_sources_share_one_outage(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    """A consumer's pullers and acker: the outage ends when none of them is failing."""
    failures = failure_log(clock, expected=(BrokerUnavailable,))
    error = BrokerUnavailable("broker unreachable: ConnectError('refused')")
    assert failures.failed(error, source="pull a") == 1
    assert failures.failed(error, source="pull a") == 2
    assert failures.failed(error, source="pull b") == 1
    assert "failing (pull a): broker unreachable" in caplog.records[0].getMessage()
    failures.succeeded(source="pull a")
    assert failures.failing
    failures.succeeded(source="ack")  # was not failing: changes nothing
    assert failures.failing
    assert failures.failed(error, source="pull a") == 1  # in a row again from one
    failures.succeeded(source="pull a")
    failures.succeeded(source="pull b")
    assert not failures.failing
    assert [r.__dict__["action"] for r in caplog.records] == [
        "test.database.failing",
        "test.database.recovered",
    ]
    assert caplog.records[-1].__dict__["failures"] == 4


def test_error_text_is_one_bounded_line() -> None:
    assert describe(OutboxStoreError("a\n  b\tc")) == "a b c"
    sqlalchemy_text = "refused\n(Background on this error at: https://sqlalche.me/e/20/e3q8)"
    assert describe(OutboxStoreError(sqlalchemy_text)) == "refused"
    assert describe(KeyError("k"), with_type=True) == "KeyError: 'k'"
    assert describe(TimeoutError()) == "TimeoutError"
    assert len(describe(OutboxStoreError("x" * 5000))) == 500


def test_urls_are_masked() -> None:
    assert mask_url("postgresql+psycopg://app:s3cret@db:5432/app") == (
        "postgresql+psycopg://app:***@db:5432/app"
    )
    assert mask_url("http://127.0.0.1:8931") == "http://127.0.0.1:8931"
    assert mask_url("http://u:p@[::1]:80/x") == "http://u:***@[::1]:80/x"
    with BrokerClient("http://user:pw@broker.internal:8931") as client:
        assert client_url(client) == "http://user:***@broker.internal:8931"
    assert client_url(object()) == "object"


def test_the_dispatcher_logs_a_broker_outage_once_and_backs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="qmq_outbox.dispatcher")
    dispatch = Dispatch(
        capacity=10, batch_size=10, cooldown=10.0, max_cooldown=20.0, target="http://b:1"
    )
    failed = SendReport(error=BrokerUnavailable("broker answered 503 recovering: later"))
    for _ in range(20):
        dispatch.completion(failed)
    assert not dispatch.breaker.allows()  # messages go to the compensator meanwhile
    dispatch.completion(SendReport())  # sent nothing: says nothing of the broker
    assert dispatch.broker.failing
    stored = ProduceResult(id="m", subject="s", status="stored", seq=1)
    dispatch.completion(SendReport(results=[stored]))
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == [
        "dispatcher: broker http://b:1 failing: broker answered 503 recovering: later; "
        "retrying with backoff",
        "dispatcher: broker http://b:1 recovered after 0.0 s, 20 failure(s)",
    ]


def test_backoff_jitters_within_the_upper_half_and_caps() -> None:
    rng = random.Random(7)
    pauses = [backoff_seconds(n, base=0.1, cap=2.0, rng=rng) for n in range(1, 12)]
    ceilings = [min(2.0, 0.1 * 2 ** (n - 1)) for n in range(1, 12)]
    assert all(c / 2 <= p <= c for p, c in zip(pauses, ceilings, strict=True))
    assert len(set(pauses)) == len(pauses)
    delay = backoff_delay(3, base=timedelta(seconds=1), cap=timedelta(seconds=3), rng=rng)
    assert timedelta(seconds=1.5) <= delay <= timedelta(seconds=3)
