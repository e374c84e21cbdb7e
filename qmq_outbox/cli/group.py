"""``qmq group reset``: move a consumer group to a position (docs/architecture.md 3.7).

One call to the broker; prints where each of the group's states reads next (``--json``: the
answer as the broker gave it). Exactly one of ``--to-seq``, ``--to-time``, ``--earliest``
and ``--latest``; a position the broker refuses (an unknown group, leases out without
``--force``) is one line and exit 2, a broker that cannot serve it exit 3.
"""

from __future__ import annotations

import click
import orjson

import qmq_wire
from qmq_outbox.calls import Position
from qmq_outbox.cli import failures
from qmq_outbox.cli.subject import PARTITION, broker_client
from qmq_outbox.cli.urls import BROKER_URL
from qmq_wire import ResetAnswerJson, rules

ENVVAR_PREFIX = "QMQ_GROUP"


@click.group()
def group() -> None:
    """Reset consumer groups (replay from a seq or a time, or skip to the end)."""


def _name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not qmq_wire.valid_name(value):
        raise click.BadParameter(
            f"{value!r} is not a name (a letter or digit, then up to 199 of A-Za-z0-9._-)"
        )
    return value


def _time(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not rules.Timestamp().accepts(value, "time", "time"):
        raise click.BadParameter(
            f"{value!r} is not an RFC 3339 time with an offset, e.g. 2026-11-28T09:00:00Z"
        )
    return value


@group.command()
@click.option("--subject", required=True, callback=_name, help="The group's subject.")
@click.option("--group", "name", required=True, callback=_name, help="The group to reset.")
@click.option("--to-seq", type=click.IntRange(0, qmq_wire.MAX_SEQ), help="Read from this seq next.")
@click.option(
    "--to-time",
    callback=_time,
    help="Read from the first message stored at or after this RFC 3339 time.",
)
@click.option("--earliest", is_flag=True, help="Read from the first retained message.")
@click.option("--latest", is_flag=True, help="Skip everything stored so far.")
@click.option(
    "--partition",
    type=PARTITION,
    help="Only this partition of an ordered subject (required there with --to-seq).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Drop the messages leased out now (their acks then answer unknown).",
)
@click.option(
    "--broker-url",
    "--url",
    required=True,
    type=BROKER_URL,
    envvar=f"{ENVVAR_PREFIX}_BROKER_URL",
    show_envvar=True,
    help="Broker base URL, e.g. http://127.0.0.1:8931.",
)
@click.option(
    "--broker-token",
    envvar=f"{ENVVAR_PREFIX}_BROKER_TOKEN",
    show_envvar=True,
    help="Bearer token for the broker (a reset needs the manage right on the group).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the broker's answer as JSON.")
@failures.reported
def reset(
    subject: str,
    name: str,
    to_seq: int | None,
    to_time: str | None,
    earliest: bool,
    latest: bool,
    partition: int | None,
    force: bool,
    broker_url: str,
    broker_token: str | None,
    as_json: bool,
) -> None:
    """Move GROUP of SUBJECT to a position: its messages from there are delivered again."""
    to = _position(to_seq, to_time, earliest, latest)
    with broker_client(broker_url, broker_token) as client:
        answer = client.reset_group(subject, name, to, force=force, partition=partition)
    if as_json:
        click.echo(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo("\n".join(reset_lines(subject, name, answer)))


def _position(to_seq: int | None, to_time: str | None, earliest: bool, latest: bool) -> Position:
    given: list[Position] = []
    if to_seq is not None:
        given.append({"seq": to_seq})
    if to_time is not None:
        given.append({"time": to_time})
    if earliest:
        given.append("earliest")
    if latest:
        given.append("latest")
    if len(given) != 1:
        raise failures.BadInput("give exactly one of --to-seq, --to-time, --earliest, --latest")
    return given[0]


def reset_lines(subject: str, group: str, answer: ResetAnswerJson) -> list[str]:
    """The answer as a few lines: each state's next seq, and the leases dropped."""
    lines = [f"group {group} on {subject}: reset, {answer['dropped_leases']} leases dropped"]
    for moved in answer["positions"]:
        where = (
            f"partition {moved['partition']}"
            if moved["partition"] is not None
            else f"consumer {moved['consumer']}"
            if moved["consumer"] is not None
            else "group"
        )
        lines.append(f"  {where:<24} next seq {moved['seq']}")
    return lines
