"""The reconciliation's outputs: ``summary.json``, Parquet per category, text and HTML reports.

``summary`` builds the ``summary.json`` document (docs/architecture.md, section 7) from collected
results; ``render_text`` and ``render_html`` are pure; ``prepare_out``,
``stage_categories``, ``publish_categories``, ``write_unreadable``, ``write_out_of_order``
and ``write_reports`` are the only functions that touch the output directory. The
classified messages are written in one pass, partitioned by category, into
``out/_categories`` and then moved to ``out/<category>/``; unreadable regions of broker
segments go to ``out/unreadable_in_broker/``, messages stored out of their outbox order to
``out/out_of_order/``, messages a group acked out of their stored order to
``out/out_of_order_acked/``.
"""

from __future__ import annotations

import dataclasses
import html
import shutil
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from qmq_reconcile.transforms import (
    ACKED_OUT_OF_ORDER_COLUMNS,
    CATEGORIES,
    CONSUMED_ONLY_COLUMNS,
    CRITICAL,
    HISTOGRAM_BOUNDS_MS,
    LATENCY_METRICS,
    OUT_OF_ORDER_COLUMNS,
    UNCONSUMED_COLUMNS,
    category_counters,
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
class _Disorder:
    """One part of the ``out_of_order`` check as written out: its Parquet folder, its
    columns, the order it is listed in, and what one of its keys is."""

    folder: str
    columns: tuple[str, ...]
    listed_by: tuple[str, ...]
    key: tuple[str, ...]


# Listed by subject and key, in stored order.
_STORED = _Disorder(
    folder=OUT_OF_ORDER,
    columns=OUT_OF_ORDER_COLUMNS,
    listed_by=("subject", "key", "outbox", "stored_at", "broker", "partition", "seq"),
    key=("outbox", "subject", "key"),
)
_ACKED = _Disorder(
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
    entry = _disorder_entry(_STORED, count, keys, listed)
    return {**entry, "acked": dict(acked or acked_entry(0, 0, []))}


def acked_entry(count: int, keys: int, listed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``out_of_order``'s ``acked``: how many messages groups acked out of their stored
    order, of how many (subject, group, key)s, and the first ``LISTED_OUT_OF_ORDER``."""
    return _disorder_entry(_ACKED, count, keys, listed)


def _disorder_entry(
    kind: _Disorder, count: int, keys: int, listed: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    messages = [
        {name: _json_value(m[name]) for name in kind.columns} for m in listed[:LISTED_OUT_OF_ORDER]
    ]
    return {"count": count, "keys": keys, "messages": messages}


def _json_value(value: Any) -> Any:
    return _fmt_time(value) if isinstance(value, datetime) else value


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


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _fmt_time(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat().replace("+00:00", "Z")


def created_words(since: datetime | None, until: datetime | None) -> str:
    """Which creation times a run judged, in words (an open bound is "any time")."""
    if since is not None and until is not None:
        return f"created between {_fmt_time(since)} and {_fmt_time(until)}"
    if since is not None:
        return f"created at any time from {_fmt_time(since)} on"
    if until is not None:
        return f"created at any time before {_fmt_time(until)}"
    return "created at any time"


def in_flight_words(info: RunInfo) -> str:
    """Which messages were too young to judge, in words."""
    return (
        f"messages created or due after {_fmt_time(info.settled_before)} "
        f"(grace {_fmt_seconds(info.grace_s)}): still in flight"
    )


def _fmt_seconds(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def render_text(doc: Mapping[str, Any], info: RunInfo) -> str:
    lines = [
        f"qmq reconcile  {_fmt_time(info.started_at)}",
        f"outboxes:     {', '.join(info.outboxes)}",
        f"broker data:  {', '.join(info.broker_dirs) or '(none: categories not judged)'}",
        f"checked:      outbox rows and broker messages {created_words(info.since, info.until)}",
        f"not judged:   {in_flight_words(info)}",
        f"producers:    {', '.join(info.producers or ['(those of the outbox rows)'])}",
        "",
        f"{'category':<22}{'count':>12}  severity",
    ]
    for name in CATEGORIES:
        count = doc["categories"][name]
        severity = SEVERITY[name].upper() if count and name in CRITICAL else SEVERITY[name]
        lines.append(f"{name:<22}{count:>12,}  {severity}" if doc["categories_judged"] else
                     f"{name:<22}{'-':>12}  not judged (no broker data)")  # fmt: skip
    lines += [*_consumed_lines(doc[CONSUMED], info)]
    lines += ["", *_unreadable_lines(doc[UNREADABLE])]
    lines += [*_out_of_order_lines(doc[OUT_OF_ORDER])]
    lines += ["", f"consumer groups (unacked past {_fmt_seconds(info.ack_threshold_s)})"]
    lines.append(f"{'subject/group':<40}{'mode':>10}{'acked':>10}{'unacked':>10}{'dead':>8}")
    for subject, groups in doc["groups"].items():
        for group, g in groups.items():
            note = "  never acked" if g["never_acked"] else ""
            lines.append(
                f"{subject + '/' + group:<40}{g['mode']:>10}{g['acked']:>10,}"
                f"{g['unacked_past_threshold']:>10,}{g['dead_letters']:>8,}{note}"
            )
    if not doc["groups"]:
        lines.append("(no consumer groups)")
    lines += ["", f"{'latency (ms)':<22}{'count':>10}{'p50':>12}{'p90':>12}{'p99':>12}{'max':>12}"]
    for metric, s in doc["latency_ms"].items():
        cells = "".join(f"{_fmt_ms(s[k]):>12}" for k in ("p50", "p90", "p99", "max"))
        lines.append(f"{metric:<22}{s['count']:>10,}{cells}")
    critical = sum(doc["categories"][c] for c in CRITICAL)
    verdict = f"{critical:,} critical finding(s)" if critical else "clean"
    if doc[UNREADABLE]["count"]:
        verdict += f"; {doc[UNREADABLE]['count']:,} unreadable region(s) in broker data"
    if doc[OUT_OF_ORDER]["count"]:
        verdict += f"; {doc[OUT_OF_ORDER]['count']:,} message(s) stored out of order"
    if doc[CONSUMED] and doc[CONSUMED][NEVER_CONSUMED]["count"]:
        verdict += f"; {doc[CONSUMED][NEVER_CONSUMED]['count']:,} message(s) never consumed"
    if doc[OUT_OF_ORDER]["acked"]["count"]:
        verdict += f"; {doc[OUT_OF_ORDER]['acked']['count']:,} message(s) acked out of order"
    lines += ["", f"result: {verdict} -> exit {doc['exit_code']}"]
    return "\n".join(lines) + "\n"


def _unreadable_lines(entry: Mapping[str, Any]) -> list[str]:
    count = entry["count"]
    severity = UNREADABLE_SEVERITY.upper() if count else UNREADABLE_SEVERITY
    lines = [f"{UNREADABLE:<22}{count:>12,}  {severity}  ({entry['bytes']:,} bytes)"]
    lines += [f"  {_region_text(r)}" for r in entry["regions"]]
    if count > len(entry["regions"]):
        lines.append(f"  ... {count - len(entry['regions']):,} more in {UNREADABLE}/")
    return lines


def _out_of_order_lines(entry: Mapping[str, Any]) -> list[str]:
    acked = entry["acked"]
    return [
        *_disorder_lines(OUT_OF_ORDER, entry, [_out_of_order_text(m) for m in entry["messages"]]),
        *_disorder_lines(
            ACKED_OUT_OF_ORDER, acked, [_acked_out_of_order_text(m) for m in acked["messages"]]
        ),
    ]


def _consumed_lines(entry: Mapping[str, Any] | None, info: RunInfo) -> list[str]:
    if entry is None:
        return []
    never, extra = entry[NEVER_CONSUMED], entry[CONSUMED_WITHOUT_OUTBOX]
    subjects = ", ".join(entry["subjects"])
    lines = [
        "",
        f"consumed by group {entry['group']} ({entry['database']}), subjects {subjects}",
        f"{NEVER_CONSUMED:<22}{never['count']:>12,}  "
        f"{'CRITICAL' if never['count'] else 'critical'}  "
        f"(sent more than {_fmt_seconds(info.ack_threshold_s)} ago)",
    ]
    lines += [
        f"  {m['message_id']} {m['subject']} created {m['created_at']} sent {m['sent_at']}"
        for m in never["messages"]
    ]
    if never["count"] > len(never["messages"]):
        lines.append(f"  ... {never['count'] - len(never['messages']):,} more in {NEVER_CONSUMED}/")
    lines.append(f"{CONSUMED_WITHOUT_OUTBOX:<22}{extra['count']:>12,}  info")
    lines += [f"  {m['message_id']} consumed {m['consumed_at']}" for m in extra["messages"]]
    if extra["count"] > len(extra["messages"]):
        more = extra["count"] - len(extra["messages"])
        lines.append(f"  ... {more:,} more in {CONSUMED_WITHOUT_OUTBOX}/")
    return lines


def _disorder_lines(name: str, entry: Mapping[str, Any], texts: list[str]) -> list[str]:
    count = entry["count"]
    severity = OUT_OF_ORDER_SEVERITY.upper() if count else OUT_OF_ORDER_SEVERITY
    lines = [f"{name:<22}{count:>12,}  {severity}  ({entry['keys']:,} key(s))"]
    lines += [f"  {text}" for text in texts]
    if count > len(texts):
        lines.append(f"  ... {count - len(texts):,} more in {name}/")
    return lines


def _out_of_order_text(message: Mapping[str, Any]) -> str:
    partition = "" if message["partition"] is None else f" partition {message['partition']}"
    return (
        f"{message['subject']} key {message['key']}: {message['message_id']} (outbox id "
        f"{message['outbox_id']}) stored after {message['after_id']} (outbox id "
        f"{message['after_outbox_id']}), {message['broker']}{partition} seq {message['seq']}"
    )


def _acked_out_of_order_text(message: Mapping[str, Any]) -> str:
    return (
        f"{message['subject']} group {message['group']} key {message['key']}: "
        f"{message['message_id']} ({message['broker']} partition {message['partition']} seq "
        f"{message['seq']}) acked at {message['acked_at']}, before {message['earlier_id']} "
        f"stored ahead of it (acked at {message['earlier_acked_at']})"
    )


def _region_text(region: Mapping[str, Any]) -> str:
    return (
        f"{region['broker']} {region['log']} segment {region['segment']} "
        f"offset {region['offset']} length {region['length']}"
    )


# --- HTML -----------------------------------------------------------------------------------


def bucket_label(bucket: int) -> str:
    if bucket >= len(HISTOGRAM_BOUNDS_MS):
        return f">= {_ms_label(HISTOGRAM_BOUNDS_MS[-1])}"
    return f"< {_ms_label(HISTOGRAM_BOUNDS_MS[bucket])}"


def _ms_label(ms: int) -> str:
    if ms >= 3_600_000:
        return f"{ms // 3_600_000} h"
    if ms >= 60_000:
        return f"{ms // 60_000} min"
    if ms >= 1_000:
        return f"{ms // 1_000} s"
    return f"{ms} ms"


def _bars(counts: Mapping[int, int]) -> str:
    if not counts:
        return "<p>no samples</p>"
    top = max(counts.values())
    rows = []
    for bucket in range(min(counts), max(counts) + 1):
        n = counts.get(bucket, 0)
        width = 0 if not top else max(n * 100 / top, 0.5 if n else 0)
        rows.append(
            f'<tr><td class="l">{html.escape(bucket_label(bucket))}</td>'
            f'<td class="b"><div style="width:{width:.1f}%"></div></td><td>{n:,}</td></tr>'
        )
    return f'<table class="h">{"".join(rows)}</table>'


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin-bottom:1.5em}
td,th{padding:.25em .8em;text-align:right;border-bottom:1px solid #ddd}
td:first-child,th:first-child{text-align:left}
.critical{color:#b00;font-weight:bold}.warning{color:#a60}
table.h td.b{width:30em}table.h td.b div{background:#4a7bd0;height:1em}
"""


def render_html(
    doc: Mapping[str, Any], info: RunInfo, histogram: Mapping[str, Mapping[int, int]]
) -> str:
    e = html.escape
    rows = []
    for name in CATEGORIES:
        count = doc["categories"][name]
        cls = SEVERITY[name] if count else ""
        shown = f"{count:,}" if doc["categories_judged"] else "not judged"
        rows.append(
            f'<tr class="{cls}"><td>{name}</td><td>{shown}</td><td>{SEVERITY[name]}</td>'
            f"<td>{e(MEANING[name])}</td></tr>"
        )
    group_rows = [
        f"<tr><td>{e(subject)}</td><td>{e(group)}</td><td>{g['mode']}</td><td>{g['acked']:,}</td>"
        f"<td>{g['unacked_past_threshold']:,}</td><td>{g['dead_letters']:,}</td>"
        f"<td>{'yes' if g['never_acked'] else ''}</td></tr>"
        for subject, groups in doc["groups"].items()
        for group, g in groups.items()
    ]
    latency_rows = [
        f"<tr><td>{metric}</td><td>{s['count']:,}</td>"
        + "".join(f"<td>{_fmt_ms(s[k])}</td>" for k in ("p50", "p90", "p99", "max"))
        + "</tr>"
        for metric, s in doc["latency_ms"].items()
    ]
    histograms = "".join(
        f"<h3>{metric}</h3>{_bars(histogram.get(metric, {}))}" for metric in LATENCY_METRICS
    )
    verdict = "clean" if doc["exit_code"] == 0 else "critical findings"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>qmq reconcile</title><style>{_CSS}</style></head>
<body>
<h1>qmq reconcile: {verdict} (exit {doc["exit_code"]})</h1>
<p>Run at {e(_fmt_time(info.started_at))}. Outboxes: {e(", ".join(info.outboxes))}.
Broker data: {e(", ".join(info.broker_dirs) or "none (categories not judged)")}.</p>
<p>Checked outbox rows and broker messages {e(created_words(info.since, info.until))}.
Not judged: {e(in_flight_words(info))}.</p>
<h2>Categories</h2>
<table><tr><th>category</th><th>count</th><th>severity</th><th>meaning</th></tr>
{"".join(rows)}</table>
{_consumed_html(doc[CONSUMED], info)}
<h2>Unreadable in broker data</h2>
{_unreadable_html(doc[UNREADABLE])}
<h2>Stored out of order</h2>
{_out_of_order_html(doc[OUT_OF_ORDER], _STORED, OUT_OF_ORDER_MEANING)}
<h2>Acked out of order</h2>
{_out_of_order_html(doc[OUT_OF_ORDER]["acked"], _ACKED, ACKED_OUT_OF_ORDER_MEANING)}
<h2>Consumer groups</h2>
<table><tr><th>subject</th><th>group</th><th>mode</th><th>acked</th>
<th>unacked past {_fmt_seconds(info.ack_threshold_s)}</th><th>dead letters</th>
<th>never acked</th></tr>
{"".join(group_rows)}</table>
<h2>Latency (ms)</h2>
<table><tr><th>metric</th><th>count</th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>
{"".join(latency_rows)}</table>
<h2>Latency histogram</h2>
{histograms}
</body></html>
"""


def _consumed_html(entry: Mapping[str, Any] | None, info: RunInfo) -> str:
    if entry is None:
        return ""
    e = html.escape
    never, extra = entry[NEVER_CONSUMED], entry[CONSUMED_WITHOUT_OUTBOX]

    def table(messages: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
        head = "".join(f"<th>{c}</th>" for c in columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{e(_cell(m[c]))}</td>" for c in columns) + "</tr>"
            for m in messages
        )
        return f"<table><tr>{head}</tr>{body}</table>" if messages else "<p>none</p>"

    cls = "critical" if never["count"] else ""
    return (
        f"<h2>Consumed by group {e(entry['group'])}</h2>"
        f"<p>Consumer database {e(entry['database'])}, subjects "
        f"{e(', '.join(entry['subjects']))}.</p>"
        f'<p class="{cls}">Never consumed (sent more than '
        f"{_fmt_seconds(info.ack_threshold_s)} ago, critical): {never['count']:,}</p>"
        f"{table(never['messages'], UNCONSUMED_COLUMNS)}"
        f"<p>Consumed without an outbox row (info): {extra['count']:,}</p>"
        f"{table(extra['messages'], CONSUMED_ONLY_COLUMNS)}"
    )


def _unreadable_html(entry: Mapping[str, Any]) -> str:
    if not entry["count"]:
        return "<p>none</p>"
    rows = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(str(r[name]))}</td>" for name in REGION_COLUMNS)
        + "</tr>"
        for r in entry["regions"]
    )
    head = "".join(f"<th>{name}</th>" for name in REGION_COLUMNS)
    return (
        f'<p class="{UNREADABLE_SEVERITY}">{entry["count"]:,} region(s), {entry["bytes"]:,} '
        f"bytes ({UNREADABLE_SEVERITY}): {html.escape(UNREADABLE_MEANING)}. Listed: the first "
        f"{len(entry['regions']):,}; all are in {UNREADABLE}/.</p>"
        f"<table><tr>{head}</tr>{rows}</table>"
    )


def _out_of_order_html(entry: Mapping[str, Any], kind: _Disorder, meaning: str) -> str:
    if not entry["count"]:
        return "<p>none</p>"
    rows = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(_cell(m[name]))}</td>" for name in kind.columns)
        + "</tr>"
        for m in entry["messages"]
    )
    head = "".join(f"<th>{name}</th>" for name in kind.columns)
    return (
        f'<p class="{OUT_OF_ORDER_SEVERITY}">{entry["count"]:,} message(s) of '
        f"{entry['keys']:,} key(s) ({OUT_OF_ORDER_SEVERITY}): "
        f"{html.escape(meaning)}. Listed: the first {len(entry['messages']):,}; "
        f"all are in {kind.folder}/.</p>"
        f"<table><tr>{head}</tr>{rows}</table>"
    )


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


# --- writing ----------------------------------------------------------------------------------


STAGING = "_categories"
# Columns of the classification whose values are (nearly) all distinct: a dictionary
# cannot encode them, and Parquet's writer would build one per column and page, then drop
# it (a third of the write's CPU). Paths as Parquet names them.
DISTINCT_COLUMNS = (
    "message_id",
    "outbox_sha256.list.element",
    "broker_sha256.list.element",
    "created_at",
    "stored_at",
    "sent_at",
)


def prepare_out(out: Path) -> None:
    """Create the output directory and drop category folders left by an earlier run."""
    out.mkdir(parents=True, exist_ok=True)
    folders = (*CATEGORIES, STAGING, UNREADABLE, OUT_OF_ORDER, ACKED_OUT_OF_ORDER)
    for name in (*folders, NEVER_CONSUMED, CONSUMED_WITHOUT_OUTBOX):
        folder = out / name
        if folder.exists():
            shutil.rmtree(folder)


def stage_categories(classified: DataFrame, out: Path) -> dict[str, int]:
    """Write the classified messages once, partitioned by category, under ``out/_categories``
    (one pass over the classification), counting them as they are written."""
    staging = out / STAGING
    counted = Observation("categories")
    observed = classified.observe(counted, *category_counters())
    writer = observed.write.mode("overwrite").partitionBy("category")
    for column in DISTINCT_COLUMNS:
        writer = writer.option(f"parquet.enable.dictionary#{column}", "false")
    writer.parquet(str(staging))
    return {str(name): int(count) for name, count in counted.get.items() if count}


def publish_categories(out: Path) -> list[str]:
    """Move each staged category to its own folder (``out/<category>/``); returns them."""
    staging = out / STAGING
    published = []
    for name in CATEGORIES:
        folder = staging / f"category={name}"
        if folder.is_dir():
            folder.rename(out / name)
            published.append(name)
    shutil.rmtree(staging, ignore_errors=True)
    return published


def write_unreadable(
    regions: DataFrame, out: Path, *, count: int, total_bytes: int
) -> dict[str, Any]:
    """When there are unreadable regions (``count`` of them, ``total_bytes`` long), write
    them all to ``out/unreadable_in_broker/``; returns their ``unreadable_entry``."""
    if not count:
        return unreadable_entry(0, 0, [])
    folder = out / UNREADABLE
    regions.write.mode("overwrite").parquet(str(folder))
    written = regions.sparkSession.read.parquet(str(folder))
    listed = written.orderBy(*REGION_COLUMNS[:4]).limit(LISTED_REGIONS).collect()
    return unreadable_entry(int(count), int(total_bytes), [r.asDict() for r in listed])


def write_out_of_order(rows: DataFrame, out: Path) -> tuple[int, int, list[dict[str, Any]]]:
    """Write the messages stored out of order (``transforms.out_of_order``) to
    ``out/out_of_order/`` (the folder is removed again when there are none); returns the
    arguments of their ``out_of_order_entry``: count, keys and the listed ones."""
    return _write_disorder(rows, out, _STORED)


def write_acked_out_of_order(rows: DataFrame, out: Path) -> dict[str, Any]:
    """Write the messages acked out of order (``transforms.acked_out_of_order``) to
    ``out/out_of_order_acked/`` (removed again when there are none); returns their
    ``acked_entry``."""
    return acked_entry(*_write_disorder(rows, out, _ACKED))


def _write_disorder(
    rows: DataFrame, out: Path, kind: _Disorder
) -> tuple[int, int, list[dict[str, Any]]]:
    folder = out / kind.folder
    rows.write.mode("overwrite").parquet(str(folder))
    written = rows.sparkSession.read.parquet(str(folder))
    totals = written.agg(
        F.count(F.lit(1)).alias("count"), F.count_distinct(*kind.key).alias("keys")
    ).collect()[0]
    if not totals["count"]:
        shutil.rmtree(folder)
        return 0, 0, []
    listed = written.orderBy(*kind.listed_by).limit(LISTED_OUT_OF_ORDER).collect()
    return int(totals["count"]), int(totals["keys"]), [r.asDict() for r in listed]


def write_consumed(
    never: DataFrame, without_outbox: DataFrame, out: Path
) -> tuple[tuple[int, list[dict[str, Any]]], tuple[int, list[dict[str, Any]]]]:
    """Write the messages never consumed and those consumed without an outbox row to
    ``out/never_consumed/`` and ``out/consumed_without_outbox/`` (each removed again when
    empty); returns each one's count and first ``LISTED_CONSUMED``."""

    def write(rows: DataFrame, name: str, order: str) -> tuple[int, list[dict[str, Any]]]:
        folder = out / name
        rows.write.mode("overwrite").parquet(str(folder))
        written = rows.sparkSession.read.parquet(str(folder))
        count = written.count()
        if not count:
            shutil.rmtree(folder)
            return 0, []
        listed = written.orderBy(order, "message_id").limit(LISTED_CONSUMED).collect()
        return count, [r.asDict() for r in listed]

    return (
        write(never, NEVER_CONSUMED, "created_at"),
        write(without_outbox, CONSUMED_WITHOUT_OUTBOX, "consumed_at"),
    )


def write_reports(out: Path, doc: Mapping[str, Any], text: str, page: str) -> None:
    (out / "summary.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    (out / "report.txt").write_text(text)
    (out / "report.html").write_text(page)
