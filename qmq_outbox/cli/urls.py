"""URLs on the command line: checked when the options are read, shown without passwords.

``DATABASE_URL`` takes a SQLAlchemy URL of a supported database whose driver is installed;
``BROKER_URL`` takes ``http(s)://host[:port]``. A value that does not fit is a usage error
naming the option (exit 2), before the command does any work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import click
from sqlalchemy.engine import URL, make_url

from qmq_outbox.dburl import mask_url, sync_database_url
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.transports.urls import check_qmq_url

SUPPORTED_DATABASES = ("postgresql", "sqlite")


def check_database_url(text: str) -> URL:
    """``text`` parsed; ``ValueError`` (the usage error's message) unless it names a supported
    database whose driver is installed."""
    try:
        url = make_url(text)
    except Exception:  # ArgumentError, or ValueError for a bad port
        raise ValueError(
            f"{mask_url(text)!r} is not a SQLAlchemy URL "
            "(e.g. postgresql+psycopg://user@host/db, sqlite:///path/to.db)"
        ) from None
    backend = url.get_backend_name()
    if backend not in SUPPORTED_DATABASES:
        supported = " or ".join(SUPPORTED_DATABASES)
        raise ValueError(f"{backend} is not supported: use a {supported} URL")
    dialect = make_url(sync_database_url(text)).get_dialect()
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        message = f"the {dialect.driver} driver for {backend} is not installed ({exc})"
        raise ValueError(message) from None
    return url


def database_url_field() -> Any:
    """The ``database_url`` setting of a command (required; its option checks it)."""
    return dataclasses.field(
        metadata={
            "help": "SQLAlchemy URL of the outbox's database (PostgreSQL or SQLite).",
            "unit": "database_url",
        }
    )


def check_broker_url(text: str) -> str:
    """``text`` unless it is not ``http(s)://host[:port]`` (``ValueError``), the rule the
    SDK applies too (``transports.urls.check_qmq_url``)."""
    try:
        return check_qmq_url(text)
    except ConfigurationError as exc:
        raise ValueError(str(exc)) from None


class CheckedUrl(click.ParamType):  # type: ignore[type-arg]
    """A URL option's value, checked by ``check``; the value stays the string given."""

    def __init__(self, name: str, check: Callable[[str], object]) -> None:
        self.name = name
        self.check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            self.check(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


DATABASE_URL = CheckedUrl("url", check_database_url)
BROKER_URL = CheckedUrl("url", check_broker_url)
