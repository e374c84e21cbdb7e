"""The ``summary.json`` document of a run (docs/architecture.md, section 7): categories,
their severity and meaning, exit codes, and the entries of the checks beside them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from qmq_reconcile.consumed import CONSUMED_ONLY_COLUMNS, UNCONSUMED_COLUMNS
from qmq_reconcile.report.words import (
    fmt_time,
)
from qmq_reconcile.transforms import (
    ACKED_OUT_OF_ORDER_COLUMNS,
    CATEGORIES,
    CRITICAL,
    LATENCY_METRICS,
    OUT_OF_ORDER_COLUMNS,
)
from qmq_reconcile.unreadable import NAME as UNREADABLE
from qmq_reconcile.unreadable import REGION_COLUMNS

EXIT_CLEAN = 0
EXIT_CRITICAL = 1
EXIT_BAD_INPUT = 2
SEVERITY = {
    "delivered": "ok",
    "missing_in_broker": "critical",
    "stuck_pending": "warning",
    "pending_but_stored": "info",
    "dead_in_outbox": "warning",
    "orphan_in_broker": "critical",
    "body_mismatch": "critical",
    "duplicate_in_broker": "critical",
}
MEANING = {
    "delivered": "outbox row and broker record agree",
    "missing_in_broker": "outbox says sent, broker has no record (lost)",
    "stuck_pending": "pending past the grace period, not in the broker",
    "pending_but_stored": "pending but stored (mark-sent lost; a resend is deduped)",
    "dead_in_outbox": "the compensator gave up",
    "orphan_in_broker": "stored with no outbox row (sent without commit)",
    "body_mismatch": "same id, different body",
    "duplicate_in_broker": "same id stored more than once",
}
# Not a category (a region is not a message): a counter with its own section.
UNREADABLE_SEVERITY = "warning"
UNREADABLE_MEANING = (
    "regions of broker segments that cannot be read (damage; the broker cannot serve "
    "the messages in them, which show up by id in their own categories)"
)
LISTED_REGIONS = 100  # in summary.json and the reports; the Parquet folder has them all
# Not a category either (an out-of-order message is still delivered, or whatever it is).
OUT_OF_ORDER = "out_of_order"  # the Parquet folder and the summary.json key
OUT_OF_ORDER_SEVERITY = "warning"
OUT_OF_ORDER_MEANING = (
    "messages stored after a message of the same outbox, subject and key with a larger "
    "outbox id (consumers reading in stored order met the newer one first)"
)
ACKED_OUT_OF_ORDER = "out_of_order_acked"  # the Parquet folder; "acked" in the summary
ACKED_OUT_OF_ORDER_MEANING = (
    "messages of an ordered subject a group acked before a message of the same key stored "
    "ahead of them (its handler met the later one first)"
)
LISTED_OUT_OF_ORDER = 100  # in summary.json and the reports; the Parquet folder has them all
# The consumer-side check (``--consumed``): committed but never consumed is critical (a
# message lost on the way), consumed without an outbox row is for information (the group may
# have other producers).
CONSUMED = "consumed"  # the summary.json key
NEVER_CONSUMED = "never_consumed"  # and the Parquet folders
CONSUMED_WITHOUT_OUTBOX = "consumed_without_outbox"
LISTED_CONSUMED = 100


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Disorder:
    """One part of the ``out_of_order`` check as written out: its Parquet folder, its
    columns, the order it is listed in, and what one of its keys is."""

    folder: str
    columns: tuple[str, ...]
    listed_by: tuple[str, ...]
    key: tuple[str, ...]


# Listed by subject and key, in stored order.
STORED = Disorder(
    folder=OUT_OF_ORDER,
    columns=OUT_OF_ORDER_COLUMNS,
    listed_by=("subject", "key", "outbox", "stored_at", "broker", "partition", "seq"),
    key=("outbox", "subject", "key"),
)
ACKED = Disorder(
    folder=ACKED_OUT_OF_ORDER,
    columns=ACKED_OUT_OF_ORDER_COLUMNS,
    listed_by=("subject", "group", "key", "stored_at", "broker", "partition", "seq"),
    key=("subject", "group", "key"),
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo:
    """What the run looked at, for the human-readable reports."""

    started_at: datetime
    outboxes: Sequence[str]
    broker_dirs: Sequence[str]
    since: datetime | None
    until: datetime | None
    settled_before: datetime
    grace_s: float
    ack_threshold_s: float
    producers: Sequence[str] | None


def exit_code(categories: Mapping[str, int], never_consumed: int = 0) -> int:
    critical = any(categories.get(c, 0) for c in CRITICAL) or never_consumed
    return EXIT_CRITICAL if critical else EXIT_CLEAN


def consumed_entry(
    *,
    database: str,
    group: str,
    subjects: Sequence[str],
    never: tuple[int, Sequence[Mapping[str, Any]]],
    without_outbox: tuple[int, Sequence[Mapping[str, Any]]],
) -> dict[str, Any]:
    """``summary.json``'s ``consumed``: the consumer database and group checked, and the
    messages committed but never consumed and consumed without an outbox row (counts and
    the first ``LISTED_CONSUMED`` of each)."""

    def part(found: tuple[int, Sequence[Mapping[str, Any]]], columns: Sequence[str]) -> Any:
        count, listed = found
        rows = [{c: _json_value(m[c]) for c in columns} for m in listed[:LISTED_CONSUMED]]
        return {"count": count, "messages": rows}

    return {
        "database": database,
        "group": group,
        "subjects": list(subjects),
        NEVER_CONSUMED: part(never, UNCONSUMED_COLUMNS),
        CONSUMED_WITHOUT_OUTBOX: part(without_outbox, CONSUMED_ONLY_COLUMNS),
    }


def unreadable_entry(
    count: int, total_bytes: int, listed: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """``summary.json``'s ``unreadable_in_broker``: how many regions, how many bytes, and
    the first ``LISTED_REGIONS`` by broker, log, segment and offset."""
    regions = [{name: r[name] for name in REGION_COLUMNS} for r in listed[:LISTED_REGIONS]]
    return {"count": count, "bytes": total_bytes, "regions": regions}


def out_of_order_entry(
    count: int,
    keys: int,
    listed: Sequence[Mapping[str, Any]],
    acked: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``summary.json``'s ``out_of_order``: how many messages were stored out of their
    outbox order, of how many (outbox, subject, key)s, and the first
    ``LISTED_OUT_OF_ORDER`` by subject, key and stored order (times as RFC 3339 text);
    ``acked``: the same of the messages groups acked out of stored order
    (``acked_entry``)."""
    entry = _disorder_entry(STORED, count, keys, listed)
    return {**entry, "acked": dict(acked or acked_entry(0, 0, []))}


def acked_entry(count: int, keys: int, listed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``out_of_order``'s ``acked``: how many messages groups acked out of their stored
    order, of how many (subject, group, key)s, and the first ``LISTED_OUT_OF_ORDER``."""
    return _disorder_entry(ACKED, count, keys, listed)


def _disorder_entry(
    kind: Disorder, count: int, keys: int, listed: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    messages = [
        {name: _json_value(m[name]) for name in kind.columns} for m in listed[:LISTED_OUT_OF_ORDER]
    ]
    return {"count": count, "keys": keys, "messages": messages}


def _json_value(value: Any) -> Any:
    return fmt_time(value) if isinstance(value, datetime) else value


def summary(
    counts: Mapping[str, int],
    groups: Iterable[Mapping[str, Any]],
    latency: Iterable[Mapping[str, Any]],
    unreadable: Mapping[str, Any] | None = None,
    out_of_order: Mapping[str, Any] | None = None,
    consumed: Mapping[str, Any] | None = None,
    *,
    judged: bool = True,
) -> dict[str, Any]:
    """The ``summary.json`` document: whether the categories were ``judged`` (not without
    broker data), every category (zeros included), the unreadable
    regions of broker data (``unreadable_entry``), the messages stored out of their outbox
    order (``out_of_order_entry``), groups nested by subject then group, latency per
    metric, the consumer-side check (``consumed_entry``, or null), and the exit code
    (unreadable regions and out-of-order messages are warnings: they do not change it;
    messages never consumed are critical)."""
    categories = {name: int(counts.get(name, 0)) for name in CATEGORIES}
    nested: dict[str, dict[str, dict[str, Any]]] = {}
    for row in sorted(groups, key=lambda r: (r["subject"], r["group"])):
        nested.setdefault(row["subject"], {})[row["group"]] = {
            "mode": row["mode"],
            "acked": int(row["acked"]),
            "unacked_past_threshold": int(row["unacked_past_threshold"]),
            "dead_letters": int(row["dead_letters"]),
            "never_acked": bool(row["never_acked"]),
        }
    stats = {row["metric"]: row for row in latency}
    latency_ms = {metric: _latency_entry(stats.get(metric)) for metric in LATENCY_METRICS}
    never = consumed[NEVER_CONSUMED]["count"] if consumed else 0
    return {
        "categories": categories,
        "categories_judged": judged,
        UNREADABLE: dict(unreadable or unreadable_entry(0, 0, [])),
        OUT_OF_ORDER: dict(out_of_order or out_of_order_entry(0, 0, [])),
        "groups": nested,
        "latency_ms": latency_ms,
        CONSUMED: dict(consumed) if consumed else None,
        "exit_code": exit_code(categories, never),
    }


def _latency_entry(row: Mapping[str, Any] | None) -> dict[str, Any]:
    if row is None or not row["count"]:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": int(row["count"]),
        **{k: round(float(row[k]), 3) for k in ("p50", "p90", "p99", "max")},
    }


# --- text -----------------------------------------------------------------------------------
