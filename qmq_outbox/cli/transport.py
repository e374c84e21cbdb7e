"""``qmq transport declare --config FILE``: make the queues (RabbitMQ) or durable consumers
(JetStream) of the groups each subject feeds, before any producer or consumer runs.

The file is TOML::

    url = "amqp://guest:guest@127.0.0.1:5672/?exchange=orders"   # or --broker-url
    start = "earliest"      # JetStream: where the declared groups start (or "latest")

    [groups]
    "orders.created" = ["billing", "shipping"]

Declaring again is harmless. A file that cannot be used is one line naming the field
(exit 2); a server that cannot be reached exit 3 (``qmq_outbox.cli.failures``).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import click

from qmq_outbox.cli import failures
from qmq_outbox.compensator.cli import TRANSPORT_URL
from qmq_outbox.dburl import mask_url
from qmq_outbox.errors import BrokerUnavailable, ConfigurationError
from qmq_outbox.transports.topology import Declaring, name_problem
from qmq_outbox.transports.urls import SCHEMES, from_url

KEYS = ("url", "start", "groups")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """What a declaration file says: where, and the groups of each subject."""

    url: str | None
    start: str | None
    groups: dict[str, list[str]]


@click.group()
def transport() -> None:
    """Declare RabbitMQ queues and JetStream consumers ahead of their consumers."""


@transport.command()
@click.option(
    "--config",
    "path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="QMQ_TRANSPORT_CONFIG",
    show_envvar=True,
    help="TOML file: url, start, and [groups] subject = [group, ...].",
)
@click.option(
    "--broker-url",
    type=TRANSPORT_URL,
    envvar="QMQ_TRANSPORT_BROKER_URL",
    show_envvar=True,
    help="nats://host:port or amqp://user:pass@host:port/ (instead of the file's url).",
)
@failures.reported
def declare(path: Path, broker_url: str | None) -> None:
    """Declare the groups of each subject in --config (again: harmless)."""
    topology = read_topology(path)
    url = broker_url or topology.url
    if url is None:
        raise failures.BadInput(f"{path}: url: missing (or give --broker-url)")
    made = _transport(path, url, topology)
    try:
        lines = made.declare()
    except BrokerUnavailable as exc:
        raise failures.Unavailable(f"{mask_url(url)}: {failures.first_line(str(exc))}") from exc
    except ConfigurationError as exc:
        raise failures.BadInput(f"{mask_url(url)}: {failures.first_line(str(exc))}") from exc
    for line in lines:
        click.echo(f"declared {line}")


def _transport(path: Path, url: str, topology: Topology) -> Declaring:
    kind = SCHEMES.get(url.split("://", 1)[0].lower()) if "://" in url else None
    if kind == "qmq":
        raise failures.BadInput(
            f"{mask_url(url)}: the qmq broker needs no declaration (a new group reads from "
            "the earliest stored message); use a nats:// or amqp:// URL"
        )
    if topology.start is not None and kind != "jetstream":
        raise failures.BadInput(
            f"{path}: start: only JetStream groups have a start; a RabbitMQ queue gets what "
            "is published after it is declared"
        )
    try:
        base = from_url(url)
        settings: dict[str, Any] = {"groups": topology.groups}
        if topology.start is not None:
            settings["groups_start"] = topology.start
        made = dataclasses.replace(base, **settings)  # type: ignore[type-var]
    except ConfigurationError as exc:
        raise failures.BadInput(f"{mask_url(url)}: {exc}") from exc
    if not isinstance(made, Declaring):
        raise failures.BadInput(f"{mask_url(url)}: this transport declares nothing")
    return made


def read_topology(path: Path) -> Topology:
    """The file at ``path``, checked; ``BadInput`` naming the first field that is wrong."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise failures.BadInput(f"{path}: {failures.reason(exc)}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise failures.BadInput(f"{path}: not TOML: {exc}") from exc

    def bad(field: str, why: str) -> failures.BadInput:
        return failures.BadInput(f"{path}: {field}: {why}")

    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise bad(unknown[0], f"unknown key (known: {', '.join(KEYS)})")
    url, start, groups = data.get("url"), data.get("start"), data.get("groups")
    if url is not None and not isinstance(url, str):
        raise bad("url", "a string, e.g. amqp://guest:guest@127.0.0.1:5672/")
    if start is not None and start not in ("earliest", "latest"):
        raise bad("start", f"earliest or latest, not {start!r}")
    if not isinstance(groups, dict) or not groups:
        raise bad("groups", 'a table of subject = ["group", ...], at least one')
    checked: dict[str, list[str]] = {}
    for subject, names in groups.items():
        field = f'groups."{subject}"'
        problem = name_problem(subject, "subject")
        if problem is not None:
            raise bad(field, problem)
        if not isinstance(names, list) or not names:
            raise bad(field, 'a list of group names, e.g. ["billing"]')
        for index, name in enumerate(names):
            problem = name_problem(name, "group")
            if problem is not None:
                raise bad(f"{field}[{index}]", problem)
        checked[subject] = list(names)
    return Topology(url=url, start=start, groups=checked)
