"""``qmq broker``: run the broker; ``qmq broker verify``: check a data directory offline.

The broker's options come from ``BrokerConfig`` and ``BrokerListener``; each is also read
from ``QMQ_BROKER_<OPTION>`` (shown in ``--help``). Before it logs or listens, the broker
checks what it needs from the machine: a data directory it can create and write, of a
format it reads, no other process holding it (``qmq_broker.storage.lock``), and a free
address; each failure is one line on stderr and exit 3 (``qmq_cli.failures``). A bad
``--auth-file`` exits 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from qmq_broker import logs
from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.errors import ConfigError, QmqBrokerError, StorageError
from qmq_broker.format.files import FORMAT_VERSION, read_format
from qmq_broker.http.auth import Authorizer
from qmq_broker.http.guard import GuardPolicy
from qmq_broker.storage import lock
from qmq_cli import failures
from qmq_cli.options import (
    Parsed,
    Unit,
    format_duration,
    option_field,
    options_from,
    parse_duration,
    take,
)

if TYPE_CHECKING:
    from qmq_broker.recovery.verify import Report

ENVVAR_PREFIX = "QMQ_BROKER"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BrokerListener:
    """Where and how the broker serves, besides what ``BrokerConfig`` tunes."""

    host: str = option_field("127.0.0.1", "Address to listen on.", "text")
    port: int = option_field(8931, "Port to listen on.", "count", min=1, max=65535)
    auth_file: Path | None = option_field(
        None,
        "JSON file of bearer tokens with produce, consume and manage rights; no auth when absent.",
        "file",
    )
    allow_host: tuple[str, ...] = option_field(
        (),
        "A Host header value served besides localhost and the bound address ('*': any); "
        "repeat for more.",
        "text",
        multiple=True,
    )
    allow_origin: tuple[str, ...] = option_field(
        (),
        "A browser Origin allowed to call the broker, e.g. https://console.example.com "
        "('*': any); requests with any other Origin header are refused. Repeat for more.",
        "text",
        multiple=True,
    )
    log_level: str = option_field(
        "INFO",
        "Least severe log lines written (JSON on stderr).",
        "choice",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        case_sensitive=False,
    )


def parse_fsync(text: str) -> FsyncPolicy:
    """``always``, ``never`` or ``interval:<ms>``."""
    try:
        return FsyncPolicy.parse(text)
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc


def parse_backoff(text: str) -> tuple[float, ...]:
    """``1s,5s,1m``: seconds before the 1st, 2nd, ... retry."""
    return tuple(parse_duration(part).total_seconds() for part in text.split(","))


def parse_read_delay(text: str) -> tuple[str, str, float]:
    """``SUBJECT:GROUP=MS`` -> (subject, group, seconds)."""
    target, _, ms = text.rpartition("=")
    subject, _, group = target.partition(":")
    try:
        seconds = float(ms) / 1000
    except ValueError:
        seconds = -1.0
    if not subject or not group or seconds < 0:
        raise ValueError(f"{text!r}: use SUBJECT:GROUP=MS")
    return subject, group, seconds


UNITS = {
    "fsync": Unit(type=Parsed("policy", parse_fsync, result=FsyncPolicy)),
    "durations": Unit(
        type=Parsed("durations", parse_backoff, result=tuple),
        show=lambda delays: ",".join(format_duration(delay) for delay in delays),
        rename=("_s", ""),
    ),
    "read_delay": Unit(
        type=Parsed("read delay", parse_read_delay, result=tuple), rename=("_s", "-ms")
    ),
}


class RunOrSubcommand(click.Group):
    """Runs its own callback when no subcommand is named; a named subcommand parses its own
    options, so the broker's (``--data-dir`` is required) are not demanded before it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            return super().parse_args(ctx, args)
        resilient, ctx.resilient_parsing = ctx.resilient_parsing, True
        try:
            return super().parse_args(ctx, args)
        finally:
            ctx.resilient_parsing = resilient


@click.group(cls=RunOrSubcommand, invoke_without_command=True)
@options_from(BrokerListener, envvar_prefix=ENVVAR_PREFIX)
@options_from(BrokerConfig, envvar_prefix=ENVVAR_PREFIX, units=UNITS)
@click.pass_context
@failures.reported
def broker(ctx: click.Context, /, **values: Any) -> None:
    """Run the broker: durable logs served over HTTP API v1.

    Produce, pull, ack, nack, dead letters and stats on --host:--port; /healthz, /metrics
    and /openapi.json beside them. `qmq broker verify --data-dir DIR` checks a data
    directory offline. See docs/broker.md.
    """
    if ctx.invoked_subcommand is not None:
        return
    config = take(BrokerConfig, values)
    listen = take(BrokerListener, values)
    try:
        authorizer = Authorizer.from_file(listen.auth_file) if listen.auth_file else None
    except QmqBrokerError as exc:
        raise failures.BadInput(f"--auth-file: {exc}") from exc
    guard = GuardPolicy.for_bind(
        listen.host, allow_hosts=listen.allow_host, allow_origins=listen.allow_origin
    )
    check_data_dir(config.data_dir)
    with owning(config.data_dir):
        check_address(listen.host, listen.port)
        logs.configure(listen.log_level)
        # imported once the directory is ours: a refused second broker exits without
        # paying for the server's imports
        from qmq_broker.server import serve

        serve(config, host=listen.host, port=listen.port, authorizer=authorizer, guard=guard)


@contextlib.contextmanager
def owning(data_dir: Path) -> Iterator[None]:
    """Hold ``data_dir``'s lock inside; ``Unavailable`` naming the holder's pid when another
    process holds it."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(lock.DataDirLock(data_dir))
        except StorageError as exc:
            raise failures.Unavailable(str(exc)) from exc
        yield


def check_data_dir(data_dir: Path) -> None:
    """Raise ``Unavailable`` unless the broker can create and write ``data_dir`` and reads
    its format (an older one is migrated by recovery; a newer one it cannot open)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = failures.reason(exc)
        raise failures.Unavailable(f"cannot create data directory {data_dir}: {reason}") from exc
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise failures.Unavailable(f"data directory {data_dir}: permission denied (not writable)")
    try:
        version = read_format(data_dir)
    except StorageError as exc:
        raise failures.Unavailable(str(exc)) from exc
    if version is None:
        return
    if not 1 <= version <= FORMAT_VERSION:
        raise failures.Unavailable(
            f"{data_dir} holds data format {version!r}; this broker reads 1 to {FORMAT_VERSION}"
        )


def check_address(host: str, port: int) -> None:
    """Raise ``Unavailable`` when ``host:port`` cannot be listened on (in use, no such
    address), rather than fail after recovery."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        reason = failures.reason(exc)
        raise failures.Unavailable(f"cannot listen on {host}:{port}: {reason}") from exc


@broker.command()
@click.option(
    "--data-dir",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    envvar=f"{ENVVAR_PREFIX}_DATA_DIR",
    show_envvar=True,
    help="Data directory to check; --repair refuses one a broker is using.",
)
@click.option(
    "--repair",
    is_flag=True,
    help="Rewrite the derived files (indexes, checkpoints, route tables) from the logs; "
    "never a segment.",
)
@click.pass_context
@failures.reported
def verify(ctx: click.Context, data_dir: Path, repair: bool) -> None:
    """Check every segment, index entry, checkpoint and route table of a data dir, offline.

    Prints one line per damage found, with what it costs, and a summary line. Exits 0 when
    clean, 1 when damage is found (after --repair: damage left), 2 for a missing or
    unreadable data directory, 3 when --repair finds a broker holding it. Without --repair
    nothing is written; a directory a broker holds is read all the same, and the output
    says so.
    """
    # imported here: the broker's own start pays for none of the checks' modules
    from qmq_broker.recovery.verify import NotADataDir
    from qmq_broker.recovery.verify import check_data_dir as check_verifiable
    from qmq_broker.recovery.verify import verify as check

    try:
        if repair:
            check_verifiable(data_dir)
            with owning(data_dir):
                report = _check_and_repair(data_dir)
        else:
            in_use = lock.probe(data_dir)
            if in_use is not None:
                click.echo(f"note: {in_use}; a broker may be writing as this reads")
            report = check(data_dir)
            _print(report)
    except NotADataDir as exc:
        raise failures.BadInput(str(exc)) from exc
    ctx.exit(0 if report.clean else 1)


def _check_and_repair(data_dir: Path) -> Report:
    from qmq_broker.recovery.repair import repair as repair_derived
    from qmq_broker.recovery.verify import verify as check

    report = check(data_dir)
    _print(report)
    if not report.clean:
        for line in repair_derived(data_dir, report).done:
            click.echo(f"repaired: {line}")
        report = check(data_dir)
        _print(report)
    return report


def _print(report: Report) -> None:
    for finding in report.findings:
        click.echo(finding.line())
    click.echo(report.summary())
