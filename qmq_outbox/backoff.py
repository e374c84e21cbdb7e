"""Exponential backoff with jitter: the compensator's ``next_attempt_at`` and the pauses of
background loops while a dependency is down."""

from __future__ import annotations

import random
from datetime import timedelta


def backoff_ceiling(attempt: int, *, base: float, cap: float) -> float:
    """``base * 2**(attempt-1)`` seconds (``attempt`` is 1-based), capped at ``cap``."""
    exponent = min(max(attempt - 1, 0), 62)
    return min(cap, base * 2.0**exponent)


def equal_jitter(seconds: float, rng: random.Random | None = None) -> float:
    """A uniform draw from the upper half of ``seconds``: spread out, never much shorter."""
    return seconds * (rng or random).uniform(0.5, 1.0)


def backoff_seconds(
    attempt: int, *, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """The pause after the ``attempt``-th failure in a row: the ceiling, with equal jitter."""
    return equal_jitter(backoff_ceiling(attempt, base=base, cap=cap), rng)


def backoff_delay(
    attempt: int, *, base: timedelta, cap: timedelta, rng: random.Random | None = None
) -> timedelta:
    """``backoff_seconds`` in ``timedelta``s: the delay before the attempt after ``attempt``."""
    seconds = backoff_seconds(attempt, base=base.total_seconds(), cap=cap.total_seconds(), rng=rng)
    return timedelta(seconds=seconds)
