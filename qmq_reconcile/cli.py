"""``qmq reconcile``: prove from the data that nothing was lost, duplicated or sent without
commit (docs/reconcile.md).

Exit codes: 0 clean, 1 critical findings, 2 bad input (one line on stderr), 3 an outbox
database could not be read or the run failed for another reason (one line on stderr;
``qmq_cli.failures``). Spark's console output goes to ``spark.log`` under ``--out``.
The options come from ``ReconcileArgs``, named as ``run``'s keywords; each is also read
from ``QMQ_RECONCILE_<OPTION>`` (shown in ``--help``).
"""

from __future__ import annotations

import dataclasses
import sys
from datetime import datetime, timedelta
from typing import Any

import click

from qmq_cli import failures
from qmq_cli.options import Parsed, Unit, option_field, options_from, take
from qmq_reconcile.errors import BadInput, OutboxUnreadable, ReconcileError, StreamUnreadable
from qmq_reconcile.job import DEFAULT_ACK_THRESHOLD, DEFAULT_GRACE, run, timings_line
from qmq_reconcile.progress import for_stream


def parse_jars(text: str) -> tuple[str, ...]:
    """``a.jar,b.jar`` -> ("a.jar", "b.jar")."""
    return tuple(jar.strip() for jar in text.split(",") if jar.strip())


def parse_conf(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{text!r}: use KEY=VALUE")
    return key.strip(), value


def _repeated(help: str, *, option: str, metavar: str) -> tuple[str, ...]:
    """A text option given once per value (``option``), its values a tuple; none by default."""
    return option_field((), help, "text", option=option, multiple=True, metavar=metavar)


UNITS = {
    "jars": Unit(type=Parsed("jars", parse_jars, result=tuple)),
    "conf": Unit(type=Parsed("conf", parse_conf, result=tuple)),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReconcileArgs:
    """The command line of one run."""

    outboxes: tuple[str, ...] = dataclasses.field(
        metadata={
            "help": "SQLAlchemy URL of an outbox database (postgresql+psycopg://..., "
            "sqlite:///...); repeat for several.",
            "unit": "text",
            "option": "--outbox",
            "multiple": True,
            "metavar": "URL",
        }
    )
    out: str = dataclasses.field(
        metadata={
            "help": "Where summary.json, report.txt, report.html and the Parquet folders go.",
            "unit": "text",
            "metavar": "DIR",
        }
    )
    broker_dirs: tuple[str, ...] = _repeated(
        "A broker data directory; repeat for several brokers (or give --jetstream).",
        option="--broker-data",
        metavar="DIR",
    )
    master: str = option_field(
        "local[*]", "Spark master: local[*], local[2], spark://host:7077, yarn, ...", "text"
    )
    grace: timedelta = option_field(
        DEFAULT_GRACE,
        "Messages created (or due) less than this before the run are in flight: not judged.",
        "duration",
    )
    since: datetime | None = option_field(
        None, "Judge messages created at or after this time (UTC unless it says).", "timestamp"
    )
    until: datetime | None = option_field(
        None, "Judge messages created before this time.", "timestamp"
    )
    producers: tuple[str, ...] = _repeated(
        "Producers whose broker messages must have an outbox row (orphans); "
        "default: the producers found in the outbox rows.",
        option="--producer",
        metavar="NAME",
    )
    ack_threshold: timedelta = option_field(
        DEFAULT_ACK_THRESHOLD,
        "Count a group's messages stored longer ago than this and not acked.",
        "duration",
    )
    jars: tuple[str, ...] | None = option_field(
        None,
        "JDBC driver jars (paths or URLs), comma-separated; shipped to the "
        "executors. Default: Debian's /usr/share/java/postgresql.jar and sqlite-jdbc.jar.",
        "jars",
        metavar="JAR[,JAR...]",
    )
    jetstream: str | None = option_field(
        None,
        "A NATS JetStream server (nats://HOST:PORT) whose --stream(s) hold the messages, "
        "instead of or besides --broker-data.",
        "text",
        metavar="URL",
    )
    streams: tuple[str, ...] = _repeated(
        "A JetStream stream to read (with --jetstream); repeat for several.",
        option="--stream",
        metavar="NAME",
    )
    consumed: str | None = option_field(
        None,
        "SQLAlchemy URL of a consumer's database: report the outbox's messages to --subject(s) "
        "that --group never handled (its qmq_consumed rows); with no broker data (RabbitMQ) "
        "this is the whole check.",
        "text",
        metavar="URL",
    )
    group: str | None = option_field(
        None, "The consumer group whose qmq_consumed rows --consumed reads.", "text"
    )
    subjects: tuple[str, ...] = _repeated(
        "A subject the --group consumes (with --consumed); repeat for several.",
        option="--subject",
        metavar="NAME",
    )
    conf: tuple[tuple[str, str], ...] = option_field(
        (),
        "Extra Spark configuration, e.g. spark.executor.memory=4g; repeatable.",
        "conf",
        multiple=True,
        metavar="KEY=VALUE",
    )


@click.command()
@options_from(ReconcileArgs, envvar_prefix="QMQ_RECONCILE", units=UNITS)
@failures.reported
def reconcile(**values: Any) -> None:
    """Reconcile outbox tables with broker logs on Spark.

    Every message lands in one category (delivered, missing_in_broker, stuck_pending,
    pending_but_stored, dead_in_outbox, orphan_in_broker, body_mismatch,
    duplicate_in_broker); unreadable regions of broker segments are counted apart
    (unreadable_in_broker, a warning). Exit 0 clean, 1 critical findings, 2 bad input,
    3 an outbox database could not be read or Spark failed.
    """
    args = take(ReconcileArgs, values)
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(args)}
    given.update(producers=list(args.producers) or None, conf=dict(args.conf))
    try:
        with for_stream(sys.stderr) as progress:  # the stages as they go, on stderr
            result = run(**given, jvm_log=True, progress=progress)
    except (OutboxUnreadable, StreamUnreadable) as exc:  # unreachable: not the caller's typo
        raise failures.Unavailable(str(exc)) from exc
    except BadInput as exc:
        raise failures.BadInput(str(exc)) from exc
    except ReconcileError as exc:
        raise failures.Unavailable(str(exc)) from exc
    except Exception as exc:  # Spark/JVM failures: one line, not a traceback
        first = failures.first_line(str(exc)) or type(exc).__name__
        raise failures.Unavailable(f"the run failed: {first}") from exc
    click.echo(result.text, nl=False)
    click.echo(f"outputs: {result.out}  ({timings_line(result.timings)})")
    sys.exit(result.exit_code)
