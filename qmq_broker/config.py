"""Broker configuration: one frozen, keyword-only record built by the CLI.

Each field's metadata describes its ``qmq broker`` option (help text, unit, bounds), so each
default is written once, here; ``qmq_broker.cli`` derives the options from the fields.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TypeVar

from qmq_broker.errors import ConfigError
from qmq_wire import (
    DEFAULT_ACK_TIMEOUT_S,
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_DELAY_S,
    MAX_BODY_BYTES,
    MAX_WAIT_MS,
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FsyncPolicy:
    """When appended records are forced to disk.

    ``always``: a produce is answered only after its batch is fsynced (group commit);
    ``interval``: answered after write(), fsynced every ``interval_ms``;
    ``never``: left to the OS.
    """

    mode: str  # "always" | "interval" | "never"
    interval_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> FsyncPolicy:
        text = text.strip()
        if text in ("always", "never"):
            return cls(mode=text)
        match = re.fullmatch(r"interval:(\d+)(ms)?", text)
        if match and int(match.group(1)) > 0:
            return cls(mode="interval", interval_ms=int(match.group(1)))
        raise ConfigError(f"fsync policy {text!r}: use always, never or interval:<ms>")

    def __str__(self) -> str:
        return f"interval:{self.interval_ms}" if self.mode == "interval" else self.mode


MIB = 1024 * 1024

Value = TypeVar("Value")


def _option(default: Value, help: str, unit: str, **more: object) -> Value:
    """A field with a default and its ``qmq broker`` option: help text, unit and bounds."""
    metadata = {"help": help, "unit": unit, **more}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BrokerConfig:
    """Everything the broker is tuned by; ``qmq broker`` derives one option from each field."""

    # storage
    data_dir: Path = dataclasses.field(
        metadata={"help": "Where the logs, indexes and checkpoints live.", "unit": "directory"}
    )
    fsync: FsyncPolicy = _option(
        FsyncPolicy(mode="always"),
        "always | interval:<ms> | never. With always, a produce is answered after fsync.",
        "fsync",
    )
    ack_fsync: FsyncPolicy = _option(
        FsyncPolicy(mode="always"),
        "always | interval:<ms> | never: when leases, acks and nacks reach the disk under "
        "--fsync always. always: an ack is answered after fsync; interval: after write(), "
        "fsynced within <ms> (a crash may forget the newest acks: those messages are "
        "delivered again); never: with the next produce or checkpoint.",
        "fsync",
    )
    on_damage: str = _option(
        "fail",
        "Damage recovery cannot make consistent (a segment missing between two others): "
        "fail (exit 1, naming it) or skip (serve around it; its messages read as unreadable).",
        "choice",
        choices=("fail", "skip"),
    )
    segment_bytes: int = _option(
        64 * MIB, "Roll log segments at this many bytes.", "bytes", min=MIB, max=2**31
    )
    retention_s: float = _option(72 * 3600, "Delete whole segments older than this.", "duration")
    retention_check_interval_s: float = _option(
        60.0, "How often segments older than --retention are looked for.", "duration"
    )
    dedup_window_s: float = _option(
        7 * 86400, "A message id seen within this window is answered 'duplicate'.", "duration"
    )
    checkpoint_interval_s: float = _option(
        10.0, "How often group state and indexes are checkpointed.", "duration"
    )
    # delivery
    ack_timeout_s: float = _option(
        DEFAULT_ACK_TIMEOUT_S,
        "Lease length of a pulled message in shared mode.",
        "duration",
    )
    partition_lease_s: float = _option(
        10.0,
        "Ordered subjects: how long a consumer keeps a partition without pulling, acking "
        "or nacking; then the partition moves to another consumer of its group.",
        "duration",
    )
    max_attempts: int = _option(
        DEFAULT_MAX_ATTEMPTS,
        "Deliveries before a message goes to the group's dead letters.",
        "count",
        min=1,
        max=1000,
    )
    backoff_s: tuple[float, ...] = _option(
        DEFAULT_BACKOFF_S,
        "Redelivery delays after the 1st, 2nd, ... failed attempt when a nack names none; "
        "the last one repeats.",
        "durations",
    )
    # requests
    max_body_bytes: int = _option(
        MAX_BODY_BYTES,
        "Largest message body in bytes (413 beyond).",
        "bytes",
        min=1,
        max=2**30,
    )
    max_request_bytes: int = _option(
        64 * MIB, "Largest request body in bytes (413 beyond).", "bytes", min=1024, max=2**31
    )
    max_wait_ms: int = _option(
        MAX_WAIT_MS,
        "Longest wait_ms a pull may ask for (longer ones are cut).",
        "count",
        min=0,
    )
    shutdown_timeout_s: float = _option(
        30.0, "On SIGTERM, how long in-flight requests may still take.", "duration"
    )
    # connections (docs/broker.md, Limits)
    header_timeout_s: float = _option(
        10.0,
        "A connection must send a complete request head within this long of connecting or "
        "of its previous response, else it is closed.",
        "duration",
    )
    idle_timeout_s: float = _option(
        5.0,
        "A kept-alive connection that sends nothing for this long after a response is "
        "closed (useful up to --header-timeout).",
        "duration",
    )
    max_connections: int = _option(
        10_000,
        "Open connections at most; more are answered 503 too_many_connections and closed "
        "(lowered to what the open-file limit allows).",
        "count",
        min=1,
        max=10**7,
    )
    # delayed messages (docs/delayed-messages.md)
    max_delay_s: float = _option(
        DEFAULT_MAX_DELAY_S,
        "Furthest deliver_at accepted (400 delay_too_long beyond).",
        "duration",
    )
    schedule_load_ahead_s: float = _option(
        300.0,
        "How early an hour of delayed messages is read into the in-memory timing wheel.",
        "duration",
    )
    schedule_tick_s: float = _option(0.5, "Slot width of the in-memory timing wheel.", "duration")
    # pull scheduling (docs/scheduling.md)
    scheduler: str = _option(
        "fair",
        "Pull scheduling: fair (an actor per subject+group, lowest virtual runtime first) "
        "or fifo (one shared request queue, for comparison).",
        "choice",
        choices=("fair", "fifo"),
    )
    workers: int = _option(
        4,
        "Pull workers: actors served at once, each with its own read thread.",
        "count",
        min=1,
        max=1024,
    )
    readahead_wait_s: float = _option(
        0.050,
        "How long a pull whose records are not in the page cache waits on the event loop "
        "for the kernel to read them ahead before a read thread reads them instead "
        "(0: at once).",
        "milliseconds",
        min=0,
        max=10_000,
    )
    time_slice_s: float = _option(
        0.005,
        "Longest run of one actor before it yields its worker.",
        "milliseconds",
        min=0.1,
        max=10_000,
    )
    anticipation_s: float = _option(
        0.020,
        "fair: how long a group answered moments ago keeps its place while its consumers "
        "pull again (their round trip; the longest recent run is added, which their pulls "
        "may wait for); actors ahead of it wait (0: never wait).",
        "milliseconds",
        min=0,
        max=1_000,
    )
    mailbox_size: int = _option(
        10_000,
        "Pending pulls (queued or parked) per subject+group before 429 mailbox_full.",
        "count",
        min=1,
        max=10**7,
    )
    max_pending_pulls: int = _option(
        8_000,
        "Pending pulls (queued or parked) of all groups together before 429 "
        "too_many_pulls; keep it below --max-connections so produce and ack get in.",
        "count",
        min=1,
        max=10**7,
    )
    pull_grace_s: float = _option(
        5.0,
        "How long past its wait_ms a pull may wait for a worker before 503 deadline_exceeded.",
        "duration",
    )
    # the console (docs/console.md)
    console_sample_interval_s: float = _option(
        10.0,
        "How often the console's history (rates, backlogs, disk use, fsync latency) is "
        "sampled; its charts show the last 360 samples.",
        "duration",
    )
    debug_read_delay_s: tuple[tuple[str, str, float], ...] = _option(
        (),
        "Benchmarks/tests only: each pull read of that group waits MS first (on the loop "
        "while it reads ahead, on its read thread otherwise): stands in for a cold disk.",
        "read_delay",
        multiple=True,
        hidden=True,
        metavar="SUBJECT:GROUP=MS",
    )
