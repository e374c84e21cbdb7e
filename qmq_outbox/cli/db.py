"""``qmq db upgrade`` / ``qmq db downgrade``: the SDK's tables, via Alembic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from qmq_outbox import migrate


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
        envvar="QMQ_DB_DATABASE_URL",
        show_envvar=True,
        help="SQLAlchemy URL of the application's database.",
    )
    @click.option("--revision", envvar="QMQ_DB_REVISION", show_envvar=True, **revision)
    def command(database_url: str, revision: str) -> None:
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
