"""``qmq broker``: run the broker (needs the ``broker`` extra)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import click

from qmq_outbox.cli.params import DURATION


def _seconds(value: timedelta) -> float:
    return value.total_seconds()


@click.command(context_settings={"show_default": True})
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    show_envvar=True,
    help="Where the logs, indexes and checkpoints live.",
)
@click.option("--host", default="127.0.0.1", show_envvar=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8931,
    show_envvar=True,
    help="Port to listen on.",
)
@click.option(
    "--fsync",
    "fsync_policy",
    default="always",
    envvar="QMQ_BROKER_FSYNC",
    show_envvar=True,
    help="always | interval:<ms> | never. With always, a produce is answered after fsync.",
)
@click.option(
    "--segment-size",
    type=click.IntRange(1024 * 1024, 2**31),
    default=64 * 1024 * 1024,
    show_envvar=True,
    help="Roll log segments at this many bytes.",
)
@click.option(
    "--retention",
    type=DURATION,
    default="72h",
    show_envvar=True,
    help="Delete whole segments older than this.",
)
@click.option(
    "--dedup-window",
    type=DURATION,
    default="7d",
    show_envvar=True,
    help="A message id seen within this window is answered 'duplicate'.",
)
@click.option(
    "--ack-timeout",
    type=DURATION,
    default="30s",
    show_envvar=True,
    help="Lease length of a pulled message in shared mode.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1, 1000),
    default=16,
    show_envvar=True,
    help="Deliveries before a message goes to the group's dead letters.",
)
@click.option(
    "--max-body-size",
    type=click.IntRange(1, 2**30),
    default=1024 * 1024,
    show_envvar=True,
    help="Largest message body in bytes (413 beyond).",
)
@click.option(
    "--max-request-size",
    type=click.IntRange(1024, 2**31),
    default=64 * 1024 * 1024,
    show_envvar=True,
    help="Largest request body in bytes (413 beyond).",
)
@click.option(
    "--checkpoint-interval",
    type=DURATION,
    default="10s",
    show_envvar=True,
    help="How often group state and indexes are checkpointed.",
)
@click.option(
    "--max-delay",
    type=DURATION,
    default="730d",
    show_envvar=True,
    help="Furthest deliver_at accepted (400 delay_too_long beyond).",
)
@click.option(
    "--schedule-load-ahead",
    type=DURATION,
    default="5m",
    show_envvar=True,
    help="How early an hour of delayed messages is read into the in-memory timing wheel.",
)
@click.option(
    "--scheduler",
    type=click.Choice(["fair", "fifo"]),
    default="fair",
    show_envvar=True,
    help="Pull scheduling: fair (an actor per subject+group, lowest virtual runtime first) "
    "or fifo (one shared request queue, for comparison).",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 1024),
    default=4,
    show_envvar=True,
    help="Pull workers: actors served at once, each with its own read thread.",
)
@click.option(
    "--time-slice-ms",
    type=click.FloatRange(0.1, 10_000),
    default=5.0,
    show_envvar=True,
    help="Longest run of one actor before it yields its worker.",
)
@click.option(
    "--mailbox-size",
    type=click.IntRange(1, 10_000_000),
    default=10_000,
    show_envvar=True,
    help="Pending pulls per subject+group before 429 mailbox_full.",
)
@click.option(
    "--pull-grace",
    type=DURATION,
    default="5s",
    show_envvar=True,
    help="How long past its wait_ms a pull may wait for a worker before 503 deadline_exceeded.",
)
@click.option(
    "--debug-read-delay-ms",
    "read_delays",
    multiple=True,
    hidden=True,
    show_envvar=True,
    metavar="SUBJECT:GROUP=MS",
    help="Benchmarks/tests only: sleep MS before each pull read of that group, on its "
    "worker thread (stands in for a cold disk).",
)
@click.option(
    "--auth-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    show_envvar=True,
    help="JSON file of bearer tokens with produce/consume rights; no auth when absent.",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_envvar=True,
)
def broker(
    data_dir: Path,
    host: str,
    port: int,
    fsync_policy: str,
    segment_size: int,
    retention: timedelta,
    dedup_window: timedelta,
    ack_timeout: timedelta,
    max_attempts: int,
    max_body_size: int,
    max_request_size: int,
    checkpoint_interval: timedelta,
    max_delay: timedelta,
    schedule_load_ahead: timedelta,
    scheduler: str,
    workers: int,
    time_slice_ms: float,
    mailbox_size: int,
    pull_grace: timedelta,
    read_delays: tuple[str, ...],
    auth_file: Path | None,
    log_level: str,
) -> None:
    """Run the broker: durable logs served over HTTP API v1.

    Produce, pull, ack, nack, dead letters and stats on --host:--port; /healthz, /metrics
    and /openapi.json beside them. See docs/broker.md.
    """
    try:
        from broker import logs
        from broker.config import BrokerConfig, FsyncPolicy
        from broker.errors import BrokerError
        from broker.http.auth import Authorizer
        from broker.server import serve
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise click.ClickException(
            f"the broker needs the 'broker' extra: pip install 'qmq-outbox[broker]' ({exc})"
        ) from exc

    try:
        policy = FsyncPolicy.parse(fsync_policy)
        authorizer = Authorizer.from_file(auth_file) if auth_file else None
        delays = tuple(_read_delay(text) for text in read_delays)
    except BrokerError as exc:
        raise click.BadParameter(str(exc)) from exc
    logs.configure(log_level)
    config = BrokerConfig(
        data_dir=data_dir,
        fsync=policy,
        segment_bytes=segment_size,
        retention_s=_seconds(retention),
        dedup_window_s=_seconds(dedup_window),
        ack_timeout_s=_seconds(ack_timeout),
        max_attempts=max_attempts,
        max_body_bytes=max_body_size,
        max_request_bytes=max_request_size,
        checkpoint_interval_s=_seconds(checkpoint_interval),
        scheduler=scheduler,
        workers=workers,
        time_slice_s=time_slice_ms / 1000,
        mailbox_size=mailbox_size,
        pull_grace_s=_seconds(pull_grace),
        debug_read_delay_s=delays,
        max_delay_s=_seconds(max_delay),
        schedule_load_ahead_s=_seconds(schedule_load_ahead),
    )
    serve(config, host=host, port=port, authorizer=authorizer)


def _read_delay(text: str) -> tuple[str, str, float]:
    """``SUBJECT:GROUP=MS`` -> (subject, group, seconds)."""
    from broker.errors import BrokerError

    target, _, ms = text.rpartition("=")
    subject, _, group = target.partition(":")
    try:
        seconds = float(ms) / 1000
    except ValueError:
        seconds = -1.0
    if not subject or not group or seconds < 0:
        raise BrokerError(f"--debug-read-delay-ms {text!r}: use SUBJECT:GROUP=MS")
    return subject, group, seconds
