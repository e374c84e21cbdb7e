"""``qmq reconcile``: prove from the data that nothing was lost, duplicated or sent without
commit (ARCHITECTURE.md §7).

Exit codes: 0 clean, 1 critical findings, 2 bad input (one line on stderr), 3 the run
failed for another reason. Spark's console output goes to ``spark.log`` under ``--out``.
PySpark is imported only when the command runs, so ``qmq --help`` works without it.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import click

from qmq_outbox.cli.params import DURATION

EXIT_BAD_INPUT = 2
EXIT_FAILED = 3


class Timestamp(click.ParamType):  # type: ignore[type-arg]
    """RFC 3339 / ISO 8601 (``2024-05-01T12:00:00Z``, ``2024-05-01``); naive means UTC."""

    name = "timestamp"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, datetime):
            return value
        try:
            parsed = datetime.fromisoformat(str(value).strip())
        except ValueError:
            self.fail(f"{value!r} is not a timestamp (use e.g. 2024-05-01T12:00:00Z)", param, ctx)
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


class OneLineErrors(click.Command):
    """Usage errors as one line (``Error: ...``) instead of usage + hint + error."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            exc.ctx = None
            raise


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"qmq reconcile: error: {message}", err=True)
    sys.exit(code)


def _conf(pairs: tuple[str, ...]) -> dict[str, str]:
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            _fail(f"--conf {pair!r}: use KEY=VALUE", EXIT_BAD_INPUT)
        conf[key.strip()] = value
    return conf


@click.command(cls=OneLineErrors)
@click.option(
    "--outbox",
    multiple=True,
    required=True,
    metavar="URL",
    show_envvar=True,
    help="SQLAlchemy URL of an outbox database (postgresql+psycopg://..., sqlite:///...); "
    "repeat for several.",
)
@click.option(
    "--broker-data",
    multiple=True,
    required=True,
    metavar="DIR",
    show_envvar=True,
    help="A broker data directory; repeat for several brokers.",
)
@click.option(
    "--out",
    required=True,
    metavar="DIR",
    show_envvar=True,
    help="Where summary.json, report.txt, report.html and the Parquet folders go.",
)
@click.option(
    "--master",
    default="local[*]",
    show_default=True,
    show_envvar=True,
    help="Spark master: local[*], local[2], spark://host:7077, yarn, ...",
)
@click.option(
    "--grace",
    type=DURATION,
    default="5m",
    show_default=True,
    show_envvar=True,
    help="Messages created (or due) less than this before the run are in flight: not judged.",
)
@click.option(
    "--since",
    type=Timestamp(),
    default=None,
    show_envvar=True,
    help="Judge messages created at or after this time (UTC unless it says).",
)
@click.option(
    "--until",
    type=Timestamp(),
    default=None,
    show_envvar=True,
    help="Judge messages created before this time.",
)
@click.option(
    "--producer",
    multiple=True,
    metavar="NAME",
    show_envvar=True,
    help="Producers whose broker messages must have an outbox row (orphans); "
    "default: the producers found in the outbox rows.",
)
@click.option(
    "--ack-threshold",
    type=DURATION,
    default="10m",
    show_default=True,
    show_envvar=True,
    help="Count a group's messages stored longer ago than this and not acked.",
)
@click.option(
    "--jars",
    default=None,
    metavar="JAR[,JAR...]",
    show_envvar=True,
    help="JDBC driver jars (paths or URLs), comma-separated; shipped to the executors. "
    "Default: Debian's /usr/share/java/postgresql.jar and sqlite-jdbc.jar.",
)
@click.option(
    "--conf",
    multiple=True,
    metavar="KEY=VALUE",
    show_envvar=True,
    help="Extra Spark configuration, e.g. spark.executor.memory=4g; repeatable.",
)
def reconcile(
    outbox: tuple[str, ...],
    broker_data: tuple[str, ...],
    out: str,
    master: str,
    grace: timedelta,
    since: datetime | None,
    until: datetime | None,
    producer: tuple[str, ...],
    ack_threshold: timedelta,
    jars: str | None,
    conf: tuple[str, ...],
) -> None:
    """Reconcile outbox tables with broker logs on Spark.

    Every message lands in one category (delivered, missing_in_broker, stuck_pending,
    pending_but_stored, dead_in_outbox, orphan_in_broker, body_mismatch,
    duplicate_in_broker). Exit 0 clean, 1 critical findings, 2 bad input.
    """
    extra_conf = _conf(conf)
    try:
        from spark_reconcile import ReconcileError, run
        from spark_reconcile.errors import BadInput
        from spark_reconcile.job import timings_line
    except ImportError as exc:
        _fail(f"needs the spark extra (pip install 'qmq-outbox[spark]'): {exc}", EXIT_BAD_INPUT)
    jar_list = None if jars is None else [j.strip() for j in jars.split(",") if j.strip()]
    try:
        result = run(
            outboxes=outbox,
            broker_dirs=broker_data,
            out=out,
            master=master,
            grace=grace,
            since=since,
            until=until,
            producers=list(producer) or None,
            ack_threshold=ack_threshold,
            jars=jar_list,
            conf=extra_conf,
            jvm_log=True,
        )
    except BadInput as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except ReconcileError as exc:
        _fail(str(exc), EXIT_FAILED)
    except Exception as exc:  # Spark/JVM failures: one line, not a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _fail(f"the run failed: {first}", EXIT_FAILED)
    click.echo(result.text, nl=False)
    click.echo(f"outputs: {result.out}  ({timings_line(result.timings)})")
    sys.exit(result.exit_code)
