"""Exponential backoff with jitter for the compensator's ``next_attempt_at``."""

from __future__ import annotations

import random
from datetime import timedelta


def backoff_delay(
    attempt: int, *, base: timedelta, cap: timedelta, rng: random.Random | None = None
) -> timedelta:
    """Delay before the attempt after ``attempt`` (1-based): ``base * 2**(attempt-1)``
    capped at ``cap``, then "equal jitter": a uniform draw from its upper half."""
    exponent = min(max(attempt - 1, 0), 62)
    ceiling = min(cap.total_seconds(), base.total_seconds() * 2.0**exponent)
    draw = (rng or random).uniform(0.5, 1.0)
    return timedelta(seconds=ceiling * draw)
