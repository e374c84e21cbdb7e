"""Numbers, times and windows as the text and HTML reports say them."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qmq_reconcile.report.summary import RunInfo


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def fmt_time(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat().replace("+00:00", "Z")


def created_words(since: datetime | None, until: datetime | None) -> str:
    """Which creation times a run judged, in words (an open bound is "any time")."""
    if since is not None and until is not None:
        return f"created between {fmt_time(since)} and {fmt_time(until)}"
    if since is not None:
        return f"created at any time from {fmt_time(since)} on"
    if until is not None:
        return f"created at any time before {fmt_time(until)}"
    return "created at any time"


def in_flight_words(info: RunInfo) -> str:
    """Which messages were too young to judge, in words."""
    return (
        f"messages created or due after {fmt_time(info.settled_before)} "
        f"(grace {fmt_seconds(info.grace_s)}): still in flight"
    )


def fmt_seconds(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"
