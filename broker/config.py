"""Broker configuration: one frozen, keyword-only record built by the CLI."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from broker.errors import BrokerError

DEFAULT_BACKOFF_S = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


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
        raise BrokerError(f"fsync policy {text!r}: use always, never or interval:<ms>")

    def __str__(self) -> str:
        return f"interval:{self.interval_ms}" if self.mode == "interval" else self.mode


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BrokerConfig:
    data_dir: Path
    fsync: FsyncPolicy = FsyncPolicy(mode="always")
    segment_bytes: int = 64 * 1024 * 1024
    retention_s: float = 72 * 3600
    dedup_window_s: float = 7 * 86400
    ack_timeout_s: float = 30.0
    max_attempts: int = 16
    backoff_s: tuple[float, ...] = DEFAULT_BACKOFF_S
    max_body_bytes: int = 1024 * 1024
    max_request_bytes: int = 64 * 1024 * 1024
    checkpoint_interval_s: float = 10.0
    retention_check_interval_s: float = 60.0
    max_wait_ms: int = 60_000
    shutdown_timeout_s: float = 30.0
    # pull scheduling (broker/scheduling): fair = one actor per (subject, group) by virtual
    # runtime; fifo = one shared request queue, kept for comparison in benchmarks
    scheduler: str = "fair"
    workers: int = 4  # actors served at once; also the number of read threads
    time_slice_s: float = 0.005  # longest run of one actor before it yields
    mailbox_size: int = 10_000  # pending pulls per (subject, group) before 429
    pull_grace_s: float = 5.0  # a pull not started within wait_ms + this is answered 503
    # benchmarks/tests only: (subject, group, seconds) slept before each pull read
    debug_read_delay_s: tuple[tuple[str, str, float], ...] = ()
    max_delay_s: float = 730 * 86400  # deliver_at at most this far ahead (2 years)
    schedule_load_ahead_s: float = 300.0  # an hour's delayed messages enter the wheel this early
    schedule_tick_s: float = 0.5  # slot width of the in-memory timing wheel

    def backoff_for(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based) when a nack names none."""
        index = min(max(attempt, 1), len(self.backoff_s)) - 1
        return self.backoff_s[index]
