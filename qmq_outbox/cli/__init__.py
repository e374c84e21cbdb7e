"""The ``qmq`` command. Subcommands load lazily so each needs only its own extra installed.

Environment variables are read here and nowhere else: every option of ``qmq <cmd>`` can be
given as ``QMQ_<CMD>_<OPTION>`` (e.g. ``QMQ_BROKER_PORT``), shown in ``--help``.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

SUBCOMMANDS = {
    "broker": ("qmq_outbox.cli.broker", "broker", "Run the broker."),
    "compensator": ("qmq_outbox.cli.compensator", "compensator", "Resend unconfirmed outbox rows."),
    "db": ("qmq_outbox.cli.db", "db", "Migrate the SDK's tables (Alembic)."),
    "reconcile": (
        "qmq_outbox.cli.reconcile",
        "reconcile",
        "Reconcile outboxes with broker logs (Spark).",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = SUBCOMMANDS.get(cmd_name)
        if spec is None:
            return None
        module = importlib.import_module(spec[0])
        command: click.Command = getattr(module, spec[1])
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"auto_envvar_prefix": "QMQ", "show_default": True})
@click.version_option(package_name="qmq-outbox")
def main() -> None:
    """qmq-outbox: reliable messaging for SQLAlchemy services."""


def run(**kwargs: Any) -> None:  # pragma: no cover - used by `python -m qmq_outbox`
    main(**kwargs)
