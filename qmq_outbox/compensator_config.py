"""How the compensator is tuned: one frozen record; ``qmq compensator`` derives its options.

Each field's metadata gives its option's help text and unit (``qmq_outbox.cli.options``),
so each default is written once, here.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TypedDict

from qmq_outbox.errors import ConfigurationError


def _option(help: str, unit: str, **more: object) -> dict[str, object]:
    """A field's ``qmq compensator`` option: help text, unit and bounds."""
    return {"help": help, "unit": unit, **more}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompensatorConfig:
    """Pass pacing, claim sizes, retries and retention of a ``Compensator``."""

    interval: timedelta = dataclasses.field(
        default=timedelta(seconds=1), metadata=_option("Pause between passes.", "duration")
    )
    batch_size: int = dataclasses.field(
        default=500,
        metadata=_option("Rows claimed and sent per batch.", "count", min=1, max=1000),
    )
    grace: timedelta = dataclasses.field(
        default=timedelta(seconds=30),
        metadata=_option("Leave rows this young to the dispatcher.", "duration"),
    )
    max_attempts: int = dataclasses.field(
        default=16, metadata=_option("Attempts before a row is marked dead.", "count", min=1)
    )
    retention: timedelta = dataclasses.field(
        default=timedelta(days=7),
        metadata=_option("Keep sent rows this long (for reconciliation).", "duration"),
    )
    lease: timedelta = dataclasses.field(
        default=timedelta(minutes=1), metadata=_option("How long a claim holds a row.", "duration")
    )
    backoff_base: timedelta = dataclasses.field(
        default=timedelta(seconds=1),
        metadata=_option(
            "Delay before the first retry; it doubles with each attempt (with jitter).", "duration"
        ),
    )
    backoff_cap: timedelta = dataclasses.field(
        default=timedelta(minutes=10), metadata=_option("Longest delay between retries.", "duration")
    )
    purge_interval: timedelta = dataclasses.field(
        default=timedelta(minutes=1),
        metadata=_option("How often sent rows past --retention are deleted.", "duration"),
    )
    purge_batch_size: int = dataclasses.field(
        default=1000, metadata=_option("Rows deleted per statement.", "count", min=1)
    )
    pass_budget: timedelta = dataclasses.field(
        default=timedelta(seconds=30),
        metadata=_option("A pass claims no new batch after running this long.", "duration"),
    )
    name: str = dataclasses.field(
        default="qmq-compensator",
        metadata=_option("Prefix of the compensator's thread names.", "text"),
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.batch_size < 1:
            raise ConfigurationError("max_attempts and batch_size must be at least 1")


class CompensatorSettings(TypedDict, total=False):
    """``CompensatorConfig``'s fields as keyword arguments of ``Compensator(...)``."""

    interval: timedelta
    batch_size: int
    grace: timedelta
    max_attempts: int
    retention: timedelta
    lease: timedelta
    backoff_base: timedelta
    backoff_cap: timedelta
    purge_interval: timedelta
    purge_batch_size: int
    pass_budget: timedelta
    name: str
