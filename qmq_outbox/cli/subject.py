"""``qmq subject``: declare ordered subjects and change their partitions (docs/architecture.md 3.6).

``create NAME --ordered``, ``routes NAME``, ``split NAME --partition P --at L``,
``merge NAME --partitions P Q`` and ``move NAME --partition P`` each make one call to the
broker and print the subject's routes as a short table (``--json``: the document as the
broker answered it). A request the broker rejects (an unknown subject, a conflicting
declaration or route change) is one line and exit 2; a broker that cannot be reached, or
answers 429/5xx, exit 3 (``qmq_outbox.cli.failures``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
import orjson

import qmq_wire
from qmq_outbox.cli import failures
from qmq_outbox.cli.urls import BROKER_URL
from qmq_outbox.client import BrokerClient
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable
from qmq_wire import RoutesAnswerJson
from qmq_wire.ordered import MAX_PARTITIONS, ON_DEAD

Command = TypeVar("Command", bound=Callable[..., Any])
ENVVAR_PREFIX = "QMQ_SUBJECT"


@click.group()
def subject() -> None:
    """Declare ordered subjects and split, merge or move their partitions."""


def _subject_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not qmq_wire.valid_name(value) or value.startswith(qmq_wire.RESERVED_PREFIX):
        raise click.BadParameter(
            f"{value!r} is not a subject name (a letter or digit, then up to 199 of "
            f"A-Za-z0-9._-, not starting with {qmq_wire.RESERVED_PREFIX})"
        )
    return value


def _common(command: Command) -> Command:
    """NAME, ``--broker-url``, ``--broker-token`` and ``--json``: every subcommand's."""
    decorators = [
        click.argument("name", callback=_subject_name),
        click.option(
            "--broker-url",
            required=True,
            type=BROKER_URL,
            envvar=f"{ENVVAR_PREFIX}_BROKER_URL",
            show_envvar=True,
            help="Broker base URL, e.g. http://127.0.0.1:8931.",
        ),
        click.option(
            "--broker-token",
            envvar=f"{ENVVAR_PREFIX}_BROKER_TOKEN",
            show_envvar=True,
            help="Bearer token for the broker (declaring and changing routes need admin).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print the routes document as JSON."),
    ]
    for decorate in reversed(decorators):
        command = decorate(command)
    return command


PARTITION = click.IntRange(0, qmq_wire.MAX_PARTITION_NUMBER)


@subject.command()
@_common
@click.option(
    "--ordered",
    is_flag=True,
    help="Declare the subject ordered (required: a plain subject needs no declaration).",
)
@click.option(
    "--partitions",
    type=click.IntRange(1, MAX_PARTITIONS),
    default=1,
    help="Physical partitions the logic partitions are spread over.",
)
@click.option(
    "--on-dead",
    type=click.Choice(ON_DEAD),
    default="skip",
    help="At a dead letter, move on (skip) or hold the partition until it is redriven (block).",
)
@failures.reported
def create(
    name: str,
    broker_url: str,
    broker_token: str | None,
    as_json: bool,
    ordered: bool,
    partitions: int,
    on_dead: qmq_wire.OnDead,
) -> None:
    """Declare NAME ordered (the same declaration again changes nothing)."""
    if not ordered:
        raise failures.BadInput("give --ordered: only ordered subjects are declared")
    with broker_client(broker_url, broker_token) as client:
        routes = client.declare_subject(name, partitions=partitions, on_dead=on_dead)
    _show(routes, as_json)


@subject.command()
@_common
@failures.reported
def routes(name: str, broker_url: str, broker_token: str | None, as_json: bool) -> None:
    """Show NAME's routes: ranges, history and each group's version."""
    with broker_client(broker_url, broker_token) as client:
        answer = client.routes(name)
    _show(answer, as_json)


@subject.command()
@_common
@click.option("--partition", type=PARTITION, required=True, help="The partition to split.")
@click.option(
    "--at",
    type=click.IntRange(1, qmq_wire.LOGIC_PARTITIONS - 1),
    required=True,
    help="The logic partition the second half starts at.",
)
@failures.reported
def split(
    name: str, broker_url: str, broker_token: str | None, as_json: bool, partition: int, at: int
) -> None:
    """Split PARTITION's logic range at AT onto two new partitions."""
    with broker_client(broker_url, broker_token) as client:
        answer = client.split_partition(name, partition=partition, at=at)
    _show(answer, as_json)


@subject.command()
@_common
@click.option(
    "--partitions",
    type=(PARTITION, PARTITION),
    required=True,
    metavar="P Q",
    help="The two partitions (adjacent ranges) to merge.",
)
@failures.reported
def merge(
    name: str,
    broker_url: str,
    broker_token: str | None,
    as_json: bool,
    partitions: tuple[int, int],
) -> None:
    """Merge two partitions with adjacent ranges onto one new partition."""
    with broker_client(broker_url, broker_token) as client:
        answer = client.merge_partitions(name, partitions=list(partitions))
    _show(answer, as_json)


@subject.command()
@_common
@click.option("--partition", type=PARTITION, required=True, help="The partition to move.")
@failures.reported
def move(
    name: str, broker_url: str, broker_token: str | None, as_json: bool, partition: int
) -> None:
    """Move PARTITION's range, unchanged, onto one new partition."""
    with broker_client(broker_url, broker_token) as client:
        answer = client.move_partition(name, partition=partition)
    _show(answer, as_json)


@contextmanager
def broker_client(url: str, token: str | None) -> Iterator[BrokerClient]:
    """A client of ``url``; what the broker refuses is bad input (exit 2), a broker that
    cannot serve it now is unavailable (exit 3)."""
    try:
        with BrokerClient(url, token=token) as client:
            yield client
    except BrokerRejected as exc:
        raise failures.BadInput(f"{url}: {failures.first_line(str(exc))}") from exc
    except BrokerUnavailable as exc:
        raise failures.Unavailable(failures.broker_message(exc, url)) from exc


# -- output ---------------------------------------------------------------------------------


def _show(routes: RoutesAnswerJson, as_json: bool) -> None:
    if as_json:
        click.echo(orjson.dumps(routes, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo("\n".join(routes_table(routes)))


def routes_table(routes: RoutesAnswerJson) -> list[str]:
    """The routes document as a few aligned lines: now, history, groups."""
    lines = [
        f"subject {routes['subject']}: ordered, route version {routes['version']}, "
        f"on_dead {routes['on_dead']}, {routes['logic_partitions']} logic partitions",
        "  logic range    partition",
    ]
    for mapped in routes["ranges"]:
        logic = f"[{mapped['lo']}, {mapped['hi']})"
        lines.append(f"  {logic:<14} {mapped['partition']}")
    lines.append("history:")
    for version in routes["history"]:
        closed = ", ".join(map(str, version["closed"])) or "-"
        spread = " ".join(f"{r['lo']}-{r['hi']}:{r['partition']}" for r in version["ranges"])
        lines.append(
            f"  v{version['version']:<3} {version['change']:<6} closed {closed:<8} {spread}"
        )
    lines.append("groups:" if routes["groups"] else "groups: none yet")
    lines += [f"  {g['group']:<24} version {g['version']}" for g in routes["groups"]]
    return lines
