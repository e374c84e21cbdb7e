"""``qmq outbox``: see and repair the outbox table (docs/outbox.md, "Operating the outbox").

``status`` counts rows per app and subject (pending, the oldest pending row's age, sent,
dead); ``dead`` lists dead rows with their reason; ``retry`` makes dead rows pending again
(safe while compensators run: ``operations.retry_dead``); ``purge`` deletes sent rows older
than a cutoff, what the compensator's ``--retention`` does, on demand. A database that
cannot be used is exit 3, bad options exit 2 (``qmq_outbox.cli.failures``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click
import orjson
import sqlalchemy as sa

import qmq_wire
from qmq_cli.options import Unit, option_field, options_from, take
from qmq_outbox import operations
from qmq_outbox.cli import failures
from qmq_outbox.cli.urls import DATABASE_URL, database_url_field
from qmq_outbox.dburl import mask_url, sync_database_url
from qmq_outbox.schema import outbox_table
from qmq_outbox.store import OutboxStore, utcnow

Command = TypeVar("Command", bound=Callable[..., Any])
ENVVAR_PREFIX = "QMQ_OUTBOX"
UNITS = {"database_url": Unit(type=DATABASE_URL)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutboxDatabase:
    """The database every ``qmq outbox`` command works on."""

    database_url: str = database_url_field()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PurgeOptions:
    """Which sent rows ``qmq outbox purge`` deletes, and how many per statement."""

    older_than: timedelta = dataclasses.field(
        metadata={"help": "Delete rows sent longer ago than this (e.g. 7d).", "unit": "duration"}
    )
    batch_size: int = option_field(1000, "Rows deleted per statement.", "count", min=1)


def _database(command: Command) -> Command:
    return options_from(OutboxDatabase, envvar_prefix=ENVVAR_PREFIX, units=UNITS)(command)


def _subject_name(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
    for value in values:
        if not qmq_wire.valid_name(value):
            raise click.BadParameter(
                f"{value!r} is not a subject name "
                "(a letter or digit, then up to 199 of A-Za-z0-9._-)"
            )
    return values


SUBJECTS = click.option(
    "--subject",
    "subjects",
    multiple=True,
    callback=_subject_name,
    help="Only rows of this subject (repeat for more).",
)
AS_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


@click.group()
def outbox() -> None:
    """See the outbox table's state; list, retry or purge its rows."""


@outbox.command()
@_database
@AS_JSON
@failures.reported
def status(as_json: bool, **values: Any) -> None:
    """Rows per app and subject: pending, the oldest pending row's age, sent, dead."""
    url = take(OutboxDatabase, values).database_url
    with _engine(url) as engine:
        rows = operations.status(engine)
    now = utcnow()
    if as_json:
        _print_json([_status_json(row, now) for row in rows])
        return
    if not rows:
        click.echo("the outbox is empty")
        return
    table = [("app", "subject", "pending", "oldest pending", "sent", "dead")]
    table += [
        (
            row.app or "-",
            row.subject,
            str(row.pending),
            format_age(_age(row.oldest_pending_at, now)) if row.oldest_pending_at else "-",
            str(row.sent),
            str(row.dead),
        )
        for row in rows
    ]
    _print_table(table, right=(2, 4, 5))


@outbox.command()
@_database
@SUBJECTS
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=100,
    show_default=True,
    envvar=f"{ENVVAR_PREFIX}_LIMIT",
    show_envvar=True,
    help="Show at most this many rows (oldest first).",
)
@AS_JSON
@failures.reported
def dead(subjects: tuple[str, ...], limit: int, as_json: bool, **values: Any) -> None:
    """Dead rows, oldest first: id, message id, app, subject, attempts, created_at, reason."""
    url = take(OutboxDatabase, values).database_url
    with _engine(url) as engine:
        rows = operations.dead_rows(engine, subjects=subjects, limit=limit)
    if as_json:
        _print_json([_dead_json(row) for row in rows])
        return
    if not rows:
        click.echo("no dead rows")
        return
    table = [("id", "message id", "app", "subject", "attempts", "created_at", "reason")]
    table += [
        (
            str(row.id),
            row.message_id,
            row.app or "-",
            row.subject,
            str(row.attempts),
            _timestamp(row.created_at),
            failures.first_line(row.reason or "") or "-",
        )
        for row in rows
    ]
    _print_table(table, right=(0, 4))
    if len(rows) == limit:
        click.echo(f"(the first {limit}: --limit shows more)")


@outbox.command()
@_database
@click.option(
    "--id",
    "ids",
    multiple=True,
    type=click.IntRange(min=1),
    help="The row with this id (as `qmq outbox dead` shows it; repeat for more).",
)
@SUBJECTS
@click.option("--all", "every", is_flag=True, help="Every dead row.")
@failures.reported
def retry(ids: tuple[int, ...], subjects: tuple[str, ...], every: bool, **values: Any) -> None:
    """Make dead rows pending again, due now with a fresh count of attempts: the
    compensator sends them. Safe while compensators run. Fix the cause first."""
    chosen = [
        name for name, given in (("--id", ids), ("--subject", subjects), ("--all", every)) if given
    ]
    if len(chosen) != 1:
        raise failures.BadInput(
            "give one of --id, --subject or --all"
            + (f", not {' and '.join(chosen)} together" if chosen else "")
        )
    url = take(OutboxDatabase, values).database_url
    with _engine(url) as engine:
        retried = operations.retry_dead(
            engine, now=utcnow(), ids=ids, subjects=subjects, every=every
        )
    click.echo(f"retried {len(retried)} dead row(s): pending again")
    missing = sorted(set(ids) - set(retried))
    if missing:
        shown = ", ".join(map(str, missing))
        raise failures.Failed(f"not dead rows (sent, pending or absent): {shown}")


@outbox.command()
@_database
@options_from(PurgeOptions, envvar_prefix=ENVVAR_PREFIX)
@failures.reported
def purge(**values: Any) -> None:
    """Delete sent rows sent longer ago than --older-than (pending and dead rows stay)."""
    url = take(OutboxDatabase, values).database_url
    options = take(PurgeOptions, values)
    before = utcnow() - options.older_than
    purged = 0
    with _engine(url) as engine:
        store = OutboxStore(engine)
        while True:
            deleted = store.purge_sent(before=before, batch_size=options.batch_size)
            purged += deleted
            if deleted < options.batch_size:
                break
    click.echo(f"purged {purged} sent row(s) sent before {_timestamp(before)}")


# -- helpers --------------------------------------------------------------------------------


@contextmanager
def _engine(url: str) -> Iterator[sa.Engine]:
    """An engine on ``url`` whose outbox table exists; its errors are exit 3 naming it."""
    engine = sa.create_engine(sync_database_url(url))
    try:
        with failures.using_database(url):
            with engine.connect() as conn:
                if not sa.inspect(conn).has_table(outbox_table.name):
                    raise failures.Unavailable(
                        f"{mask_url(url)} has no {outbox_table.name} table: "
                        "create it with qmq db upgrade --database-url URL"
                    )
            yield engine
    finally:
        engine.dispose()


def _age(at: datetime | None, now: datetime) -> float:
    return max(0.0, (now - at).total_seconds()) if at is not None else 0.0


def format_age(seconds: float) -> str:
    """``42s``, ``5m12s``, ``3h04m``, ``2d03h``: two units at most."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _timestamp(at: datetime) -> str:
    return at.isoformat(timespec="seconds").replace("+00:00", "Z")


def _status_json(row: operations.StatusRow, now: datetime) -> dict[str, Any]:
    return {
        "app": row.app,
        "subject": row.subject,
        "pending": row.pending,
        "oldest_pending_age_s": round(_age(row.oldest_pending_at, now), 3)
        if row.oldest_pending_at
        else None,
        "sent": row.sent,
        "dead": row.dead,
    }


def _dead_json(row: operations.DeadRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "message_id": row.message_id,
        "app": row.app,
        "subject": row.subject,
        "key": row.key,
        "attempts": row.attempts,
        "created_at": _timestamp(row.created_at),
        "reason": row.reason,
    }


def _print_json(value: object) -> None:
    click.echo(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode())


def _print_table(rows: Sequence[Sequence[str]], *, right: tuple[int, ...]) -> None:
    """Aligned columns; those in ``right`` (numbers) to the right; the last one unpadded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        cells[-1] = row[-1] if len(row) - 1 not in right else cells[-1]
        click.echo("  ".join(cells).rstrip())
