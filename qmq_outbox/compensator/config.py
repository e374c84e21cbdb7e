"""How the compensator is tuned: one frozen record; ``qmq compensator`` derives its options.

Each field's metadata gives its option's help text and unit (``qmq_cli.options``),
so each default is written once, here.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TypedDict

from qmq_cli.options import option_field
from qmq_outbox.errors import ConfigurationError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompensatorConfig:
    """Pass pacing, claim sizes, retries and retention of a ``Compensator``."""

    interval: timedelta = option_field(timedelta(seconds=1), "Pause between passes.", "duration")
    batch_size: int = option_field(
        500, "Rows claimed and sent per batch.", "count", min=1, max=1000
    )
    grace: timedelta = option_field(
        timedelta(seconds=30), "Leave rows this young to the dispatcher.", "duration"
    )
    max_attempts: int | None = option_field(
        None,
        "Attempts before a row the broker keeps failing (unavailable) is marked dead; "
        "unset: never. A refused configuration (token, right, URL) never kills a row.",
        "count",
        min=1,
    )
    unroutable_dead_after: timedelta = option_field(
        timedelta(days=1),
        "Mark a row dead once no queue has taken it (RabbitMQ: no consumer group bound to "
        "its subject) by this age; until then it is retried with backoff.",
        "duration",
    )
    retention: timedelta = option_field(
        timedelta(days=7), "Keep sent rows this long (for reconciliation).", "duration"
    )
    lease: timedelta = option_field(
        timedelta(minutes=1), "How long a claim holds a row.", "duration"
    )
    backoff_base: timedelta = option_field(
        timedelta(seconds=1),
        "Delay before the first retry; it doubles with each attempt (with jitter).",
        "duration",
    )
    backoff_cap: timedelta = option_field(
        timedelta(minutes=10), "Longest delay between retries.", "duration"
    )
    purge_interval: timedelta = option_field(
        timedelta(minutes=1), "How often sent rows past --retention are deleted.", "duration"
    )
    purge_batch_size: int = option_field(1000, "Rows deleted per statement.", "count", min=1)
    pass_budget: timedelta = option_field(
        timedelta(seconds=30), "A pass claims no new batch after running this long.", "duration"
    )
    name: str = option_field("qmq-compensator", "Prefix of the compensator's thread names.", "text")
    outage_summary: timedelta = option_field(
        timedelta(minutes=1),
        "While the database or the broker is down, log a summary this often.",
        "duration",
    )

    def __post_init__(self) -> None:
        if (self.max_attempts is not None and self.max_attempts < 1) or self.batch_size < 1:
            raise ConfigurationError("max_attempts and batch_size must be at least 1")


class CompensatorSettings(TypedDict, total=False):
    """``CompensatorConfig``'s fields as keyword arguments of ``Compensator(...)``."""

    interval: timedelta
    batch_size: int
    grace: timedelta
    max_attempts: int | None
    unroutable_dead_after: timedelta
    retention: timedelta
    lease: timedelta
    backoff_base: timedelta
    backoff_cap: timedelta
    purge_interval: timedelta
    purge_batch_size: int
    pass_budget: timedelta
    name: str
    outage_summary: timedelta
