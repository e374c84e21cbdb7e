"""``qmq db upgrade`` / ``qmq db downgrade``: the SDK's tables, via Alembic.

A URL that is not a supported database is a usage error (exit 2); a database that cannot
be reached or refuses the migration is one line naming it (exit 3); an unknown revision
exit 2 (``qmq_outbox.cli.failures``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from qmq_outbox import migrate
from qmq_outbox.cli import failures
from qmq_outbox.cli.urls import DATABASE_URL


@click.group()
def db() -> None:
    """Create or migrate qmq_outbox and qmq_consumed (version table qmq_alembic_version)."""


def _migration(
    name: str, run: Callable[[str, str], None], *, summary: str, revision: dict[str, Any]
) -> click.Command:
    """``qmq db <name> --database-url URL --revision REV``, running ``run(url, rev)``."""

    @db.command(name=name, help=summary)
    @click.option(
        "--database-url",
        required=True,
        type=DATABASE_URL,
        envvar="QMQ_DB_DATABASE_URL",
        show_envvar=True,
        help="SQLAlchemy URL of the application's database (PostgreSQL or SQLite).",
    )
    @click.option("--revision", envvar="QMQ_DB_REVISION", show_envvar=True, **revision)
    @failures.reported
    def command(database_url: str, revision: str) -> None:
        with failures.using_database(database_url):
            run(database_url, revision)
        click.echo(f"qmq tables at {revision}")

    return command


upgrade = _migration(
    "upgrade",
    migrate.upgrade,
    summary="Migrate the SDK's tables up to REVISION.",
    revision={"default": "head", "help": "Target revision."},
)
downgrade = _migration(
    "downgrade",
    migrate.downgrade,
    summary="Migrate the SDK's tables down to REVISION.",
    revision={
        "required": True,
        "help": 'Target revision ("-1" one step, "base" drops the tables).',
    },
)
