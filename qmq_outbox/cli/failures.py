"""How the SDK's commands fail: the ground's failures (``qmq_cli.failures``), plus what the
SDK's own errors and its drivers' read as.

A bad Alembic revision or a ``ConfigurationError`` is bad input (exit 2); ``using_database``
and ``using_broker`` name the URL a driver error came from (passwords masked), exit 3. The
SDK's commands decorate their callbacks with this module's ``reported``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from qmq_cli import failures
from qmq_cli.failures import (
    BadInput,
    Callback,
    Failed,
    Failure,
    Unavailable,
    debugging,
    first_line,
    reason,
)
from qmq_outbox.dburl import mask_url
from qmq_outbox.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    OutboxStoreError,
)

__all__ = [  # the ground's names the SDK's commands use, beside the SDK's own
    "BadInput",
    "Failed",
    "Failure",
    "Unavailable",
    "broker_message",
    "database_message",
    "debugging",
    "first_line",
    "reason",
    "reported",
    "translate",
    "using_broker",
    "using_database",
]

# psycopg says where it failed to connect; the line already names the URL, so keep the why.
_CONNECT_PREFIX = re.compile(r"^(?:connection failed: )?(?:connection to server .*? failed: )?")
_SEVERITY = re.compile(r"^(?:FATAL|ERROR):\s+")


def reported(callback: Callback) -> Callback:
    """Decorate a command's callback: what it raises becomes a ``Failure`` (``translate``)."""
    return failures.reported_with(translate, callback)


def translate(exc: Exception) -> Failure:
    """The ``Failure`` that reports ``exc`` in one line: the SDK's bad input, or as the
    ground reads it."""
    from alembic.util import CommandError  # here: the SDK imports this package, not Alembic

    if isinstance(exc, CommandError | ConfigurationError):  # a bad revision, setting, value
        return BadInput(str(exc))
    return failures.translate(exc)


@contextmanager
def using_database(url: str) -> Iterator[None]:
    """Database errors inside become ``Unavailable`` naming ``url``."""
    try:
        yield
    except (sa.exc.SQLAlchemyError, OutboxStoreError) as exc:
        raise Unavailable(database_message(exc, url)) from exc


@contextmanager
def using_broker(url: str) -> Iterator[None]:
    """Broker errors inside become ``Unavailable`` naming ``url``."""
    try:
        yield
    except BrokerError as exc:
        raise Unavailable(broker_message(exc, url)) from exc


def database_message(exc: Exception, url: str) -> str:
    """``cannot connect to URL: why`` for a failed connection, ``URL: why`` otherwise."""
    where = mask_url(url)
    error = exc.__cause__ if isinstance(exc, OutboxStoreError) else exc
    if not isinstance(error, sa.exc.DBAPIError):
        return f"{where}: {first_line(str(exc))}"
    why = _SEVERITY.sub("", _CONNECT_PREFIX.sub("", first_line(str(error.orig))))
    if error.statement is None:
        return f"cannot connect to {where}: {failures.lower_first(why)}"
    return f"{where}: {why}"


def broker_message(exc: BrokerError, url: str) -> str:
    """``cannot reach broker at URL: why`` when it did not answer, ``URL: what it answered``."""
    if isinstance(exc, BrokerUnavailable) and exc.__cause__ is not None:
        return f"cannot reach broker at {url}: {reason(exc.__cause__)}"
    return f"{url}: {exc}"
