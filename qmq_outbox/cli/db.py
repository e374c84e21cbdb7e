"""``qmq db upgrade`` / ``qmq db downgrade``: the SDK's tables, via Alembic."""

from __future__ import annotations

import click

from qmq_outbox import migrate

_database_url = click.option(
    "--database-url",
    required=True,
    envvar="QMQ_DB_DATABASE_URL",
    show_envvar=True,
    help="SQLAlchemy URL of the application's database.",
)


@click.group()
def db() -> None:
    """Create or migrate qmq_outbox and qmq_consumed (version table qmq_alembic_version)."""


@db.command()
@_database_url
@click.option(
    "--revision",
    default="head",
    show_default=True,
    envvar="QMQ_DB_REVISION",
    show_envvar=True,
    help="Target revision.",
)
def upgrade(database_url: str, revision: str) -> None:
    """Migrate the SDK's tables up to REVISION."""
    migrate.upgrade(database_url, revision)
    click.echo(f"qmq tables at {revision}")


@db.command()
@_database_url
@click.option(
    "--revision",
    required=True,
    envvar="QMQ_DB_REVISION",
    show_envvar=True,
    help='Target revision ("-1" one step, "base" drops the tables).',
)
def downgrade(database_url: str, revision: str) -> None:
    """Migrate the SDK's tables down to REVISION."""
    migrate.downgrade(database_url, revision)
    click.echo(f"qmq tables at {revision}")
