"""The CLI's URL checks and how it words a failure: pure logic, no process, no server."""

from __future__ import annotations

import errno
import re

import httpx
import pytest
import sqlalchemy as sa

from qmq_outbox.cli import failures
from qmq_outbox.cli.urls import check_broker_url, check_database_url
from qmq_outbox.dburl import mask_passwords, mask_url
from qmq_outbox.errors import (
    BrokerRejected,
    BrokerUnavailable,
    ConfigurationError,
    OutboxStoreError,
)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8931", "https://broker.example.com", "http://[::1]:8931/", "http://b"],
)
def test_a_broker_url_is_http_or_https_host_and_port(url: str) -> None:
    assert check_broker_url(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "not-a-url",
        "127.0.0.1:8931",
        "ftp://h:21",
        "http://",
        "http://h:99999",
        "http://h:port",
        "http://h:1/v1",
        "http://h:1?x=1",
        "http://user:pw@h:1",
    ],
)
def test_anything_else_is_refused_without_showing_a_password(url: str) -> None:
    with pytest.raises(ValueError, match=r"use http\(s\)://host\[:port\]") as refused:
        check_broker_url(url)
    assert "pw@" not in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u@h/db",
        "postgresql://u:pw@h:5432/db",
        "postgresql+asyncpg://u@h/db",  # run through its blocking driver
        "sqlite:///app.db",
        "sqlite+aiosqlite:///app.db",
    ],
)
def test_a_database_url_of_a_supported_database_passes(url: str) -> None:
    assert check_database_url(url).get_backend_name() in ("postgresql", "sqlite")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("notaurl", "'notaurl' is not a SQLAlchemy URL"),
        ("postgresql://u:pw@h:port/db", "'postgresql://u:***@h:port/db' is not a SQLAlchemy URL"),
        ("mysql://u@h/db", "mysql is not supported: use a postgresql or sqlite URL"),
        ("oracle://u@h/db", "oracle is not supported"),
        ("postgresql+pg8000://u@h/db", "the pg8000 driver for postgresql is not installed"),
    ],
)
def test_a_database_url_that_cannot_work_is_refused(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        check_database_url(url)


def test_passwords_are_masked_in_urls_and_in_text() -> None:
    assert mask_url("postgresql://u:pw@h/db") == "postgresql://u:***@h/db"
    assert mask_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert (
        mask_passwords("outbox 'x://a:b@c' and y://d:e@f") == "outbox 'x://a:***@c' and y://d:***@f"
    )


def _operational(message: str, statement: str | None) -> sa.exc.OperationalError:
    return sa.exc.OperationalError(statement, None, Exception(message))


@pytest.mark.parametrize(
    ("driver_says", "line"),
    [
        (
            'connection failed: connection to server at "127.0.0.1", port 5999 failed: '
            "Connection refused\n\tIs the server running on that host?",
            "cannot connect to postgresql://u:***@h/db: connection refused",
        ),
        (
            'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
            'FATAL:  database "db" does not exist',
            'cannot connect to postgresql://u:***@h/db: database "db" does not exist',
        ),
        ("unable to open database file", "cannot connect to postgresql://u:***@h/db: unable to"),
    ],
)
def test_a_failed_connection_names_the_masked_url_and_why(driver_says: str, line: str) -> None:
    message = failures.database_message(_operational(driver_says, None), "postgresql://u:pw@h/db")
    assert message.startswith(line)


def test_a_failed_statement_names_the_url_and_the_driver_s_reason() -> None:
    error = _operational("permission denied for table qmq_outbox\nLINE 1: ...", "SELECT 1")
    wrapped = OutboxStoreError("outbox claim failed")
    wrapped.__cause__ = error
    message = failures.database_message(wrapped, "postgresql://u@h/db")
    assert message == "postgresql://u@h/db: permission denied for table qmq_outbox"


def test_a_broker_that_did_not_answer_is_named_with_the_os_reason() -> None:
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    transport = httpx.ConnectError("[Errno 111] Connection refused")
    transport.__cause__ = refused
    error = BrokerUnavailable("broker unreachable")
    error.__cause__ = transport
    message = failures.broker_message(error, "http://b:1")
    assert message == "cannot reach broker at http://b:1: connection refused"


def test_a_broker_that_answered_is_quoted() -> None:
    error = BrokerRejected(status=404, code="not_found", message="no such route")
    assert failures.broker_message(error, "http://b:1") == (
        "http://b:1: broker answered 404 not_found: no such route"
    )


def test_exit_codes_by_kind() -> None:
    assert (
        failures.translate(PermissionError(errno.EACCES, "Permission denied", "/d")).exit_code == 3
    )
    assert failures.translate(ConfigurationError("batch_size must be at least 1")).exit_code == 2
    assert failures.translate(RuntimeError("boom")).exit_code == 1
    assert "qmq --debug" in failures.translate(RuntimeError("boom")).format_message()
    assert failures.BadInput("x").exit_code == 2
    assert failures.Unavailable("x").exit_code == 3
    assert failures.Failed("x").exit_code == 1
