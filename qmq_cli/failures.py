"""How a ``qmq`` command fails: one line on stderr naming what and where, and an exit code.

Exit codes: 1 the work ran and some of it failed (or found problems); 2 usage or bad input;
3 a dependency (database, broker, disk) could not be used. ``qmq --debug`` adds the
traceback. A command raises a ``Failure`` (``Failed``, ``BadInput``, ``Unavailable``), or
lets ``reported`` translate what its callback raised. A part whose own errors read
differently decorates its callbacks with ``reported_with`` and its own ``translate``
(the SDK's: ``qmq_outbox.cli.failures``). Nothing here knows a part's errors.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import click

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3

Callback = TypeVar("Callback", bound=Callable[..., Any])

_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")


@dataclasses.dataclass(kw_only=True)
class Reporting:
    """How failures are shown: ``debug`` (``qmq --debug``) adds the traceback."""

    debug: bool = False


class Failure(click.ClickException):
    """A command failed in a way it expects; ``where`` is the command (``qmq db upgrade``)."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        ctx = click.get_current_context(silent=True)
        self.where = ctx.command_path if ctx is not None else "qmq"


class Failed(Failure):
    """The work ran and some of it failed."""


class BadInput(Failure):
    """An option or argument cannot be used as given."""

    exit_code = EXIT_USAGE


class Unavailable(Failure):
    """A database, broker or directory the command needs could not be used."""

    exit_code = EXIT_UNAVAILABLE


def show(failure: Failure, reporting: Reporting) -> None:
    """Write ``failure`` to stderr: its traceback under ``--debug``, then its one line."""
    if reporting.debug:
        traceback.print_exception(failure)
    line = mask_passwords(failure.format_message())
    click.echo(f"{failure.where}: error: {line}", err=True)


def debugging() -> bool:
    """Whether the running command was started with ``qmq --debug``."""
    ctx = click.get_current_context(silent=True)
    reporting = ctx.find_object(Reporting) if ctx is not None else None
    return reporting is not None and reporting.debug


def reported(callback: Callback) -> Callback:
    """Decorate a command's callback: what it raises becomes a ``Failure`` (``translate``)."""
    return reported_with(translate, callback)


def reported_with(translator: Callable[[Exception], Failure], callback: Callback) -> Callback:
    """``callback`` with what it raises (click's own exceptions aside) made a ``Failure`` by
    ``translator``."""

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            raise translator(exc) from exc

    return run  # type: ignore[return-value]


def translate(exc: Exception) -> Failure:
    """The ``Failure`` that reports ``exc`` in one line."""
    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, click.ClickException):  # click's own (exit 1), e.g. a FileError
        return Failed(exc.format_message())
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return Unavailable(f"{where}{reason(exc)}")
    first = first_line(str(exc)) or "no message"
    return Failed(f"unexpected {type(exc).__name__}: {first} (qmq --debug shows the traceback)")


def reason(exc: BaseException) -> str:
    """Why ``exc`` happened in a few words: the OS's reason when one is in its causes."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            # errno's own text: some callers append their context to strerror
            text = os.strerror(cause.errno) if cause.errno and cause.errno > 0 else cause.strerror
            return lower_first(text)
        cause = cause.__cause__ or cause.__context__
    return first_line(str(exc)) or type(exc).__name__


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def lower_first(text: str) -> str:
    """``Connection refused`` -> ``connection refused``; ``SSL error`` stays."""
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def mask_passwords(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it replaced."""
    return _PASSWORD.sub(r"\1***@", text)
