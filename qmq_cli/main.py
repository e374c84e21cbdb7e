"""The ``qmq`` command, composed at the top from each part's own CLI module.

Each subcommand's module is imported only when it runs, so each needs only its own extra
installed. Environment variables are read in the CLI layer and nowhere else: every option
of ``qmq <cmd>`` can be given as ``QMQ_<CMD>_<OPTION>`` (e.g. ``QMQ_BROKER_PORT``), shown in
``--help``. A failure is one line on stderr and an exit code (``qmq_cli.failures``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from qmq_cli import failures


def _broker() -> click.Command:
    from qmq_broker.cli import broker

    return broker


def _compensator() -> click.Command:
    from qmq_outbox.compensator.cli import compensator

    return compensator


def _db() -> click.Command:
    from qmq_outbox.cli.db import db

    return db


def _group() -> click.Command:
    from qmq_outbox.cli.group import group

    return group


def _outbox() -> click.Command:
    from qmq_outbox.cli.outbox import outbox

    return outbox


def _subject() -> click.Command:
    from qmq_outbox.cli.subject import subject

    return subject


def _transport() -> click.Command:
    from qmq_outbox.cli.transport import transport

    return transport


def _reconcile() -> click.Command:
    from qmq_reconcile.cli import reconcile

    return reconcile


@dataclasses.dataclass(frozen=True, kw_only=True)
class Subcommand:
    """How to load a subcommand, the extra it needs installed, and its one-line help."""

    load: Callable[[], click.Command]
    extra: str | None
    help: str


SUBCOMMANDS = {
    "broker": Subcommand(load=_broker, extra="broker", help="Run the broker."),
    "compensator": Subcommand(
        load=_compensator, extra=None, help="Resend unconfirmed outbox rows."
    ),
    "db": Subcommand(load=_db, extra=None, help="Migrate the SDK's tables (Alembic)."),
    "group": Subcommand(
        load=_group,
        extra=None,
        help="Reset consumer groups: replay from a seq or a time, or skip ahead.",
    ),
    "outbox": Subcommand(
        load=_outbox,
        extra=None,
        help="Outbox rows per app and subject; list, retry or purge them.",
    ),
    "subject": Subcommand(
        load=_subject,
        extra=None,
        help="Declare ordered subjects; split, merge or move partitions.",
    ),
    "transport": Subcommand(
        load=_transport,
        extra=None,
        help="Declare RabbitMQ queues and JetStream consumers before traffic.",
    ),
    "reconcile": Subcommand(
        load=_reconcile,
        extra="spark",
        help="Reconcile outboxes with broker logs (Spark).",
    ),
}


class LazyGroup(click.Group):
    """Loads subcommands on demand; reports a failure as one line on stderr and exits with
    its code (usage errors 2, see ``failures``), with the traceback under ``--debug``."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        reporting = failures.Reporting()
        try:
            result = super().main(
                args, prog_name, complete_var, standalone_mode=False, obj=reporting, **extra
            )
        except click.UsageError as exc:  # bad option, bad value, missing argument
            where = exc.ctx.command_path if exc.ctx else "qmq"
            message = failures.mask_passwords(exc.format_message())
            click.echo(f"{where}: error: {message}", err=True)
            sys.exit(failures.EXIT_USAGE)
        except click.Abort:
            click.echo("qmq: aborted", err=True)
            sys.exit(failures.EXIT_FAILED)
        except Exception as exc:  # a Failure, or raised outside any command's callback
            failure = failures.translate(exc)
            if failure is not exc:
                failure.__cause__ = exc  # so that --debug shows where it came from
            failures.show(failure, reporting)
            sys.exit(failure.exit_code)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = SUBCOMMANDS.get(cmd_name)
        if spec is None:
            return None
        try:
            return spec.load()
        except ImportError as exc:
            if spec.extra is None:
                raise
            raise click.UsageError(
                f"{cmd_name} needs the '{spec.extra}' extra: "
                f"pip install 'qmq-outbox[{spec.extra}]' ({exc})"
            ) from exc

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name].help) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"auto_envvar_prefix": "QMQ", "show_default": True})
@click.version_option(package_name="qmq-outbox")
@click.option(
    "--debug",
    is_flag=True,
    show_envvar=True,
    help="On a failure, print the traceback as well as the one-line error.",
)
@click.pass_obj
def main(reporting: failures.Reporting, debug: bool) -> None:
    """qmq-outbox: reliable messaging for SQLAlchemy services.

    Every option of `qmq <command>` can also come from an environment variable
    QMQ_<COMMAND>_<OPTION> (for example QMQ_BROKER_PORT), shown in each command's --help.
    Durations read 500ms, 30s, 5m, 2h, 7d; a bare number means seconds.

    Exit codes: 0 done; 1 the work ran and some of it failed; 2 bad usage or input;
    3 a database, broker or directory it needs could not be used (docs/troubleshooting.md).
    """
    reporting.debug = debug
