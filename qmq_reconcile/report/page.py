"""``report.html``: the summary document rendered as one self-contained page (pure)."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from qmq_reconcile.consumed import CONSUMED_ONLY_COLUMNS, UNCONSUMED_COLUMNS
from qmq_reconcile.report import words
from qmq_reconcile.report.summary import (
    ACKED,
    ACKED_OUT_OF_ORDER_MEANING,
    CONSUMED,
    CONSUMED_WITHOUT_OUTBOX,
    MEANING,
    NEVER_CONSUMED,
    OUT_OF_ORDER,
    OUT_OF_ORDER_MEANING,
    OUT_OF_ORDER_SEVERITY,
    SEVERITY,
    STORED,
    UNREADABLE_MEANING,
    UNREADABLE_SEVERITY,
    Disorder,
    RunInfo,
)
from qmq_reconcile.transforms import (
    CATEGORIES,
    HISTOGRAM_BOUNDS_MS,
    LATENCY_METRICS,
)
from qmq_reconcile.unreadable import NAME as UNREADABLE
from qmq_reconcile.unreadable import REGION_COLUMNS


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
        + "".join(f"<td>{words.fmt_ms(s[k])}</td>" for k in ("p50", "p90", "p99", "max"))
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
<p>Run at {e(words.fmt_time(info.started_at))}. Outboxes: {e(", ".join(info.outboxes))}.
Broker data: {e(", ".join(info.broker_dirs) or "none (categories not judged)")}.</p>
<p>Checked outbox rows and broker messages {e(words.created_words(info.since, info.until))}.
Not judged: {e(words.in_flight_words(info))}.</p>
<h2>Categories</h2>
<table><tr><th>category</th><th>count</th><th>severity</th><th>meaning</th></tr>
{"".join(rows)}</table>
{_consumed_html(doc[CONSUMED], info)}
<h2>Unreadable in broker data</h2>
{_unreadable_html(doc[UNREADABLE])}
<h2>Stored out of order</h2>
{_out_of_order_html(doc[OUT_OF_ORDER], STORED, OUT_OF_ORDER_MEANING)}
<h2>Acked out of order</h2>
{_out_of_order_html(doc[OUT_OF_ORDER]["acked"], ACKED, ACKED_OUT_OF_ORDER_MEANING)}
<h2>Consumer groups</h2>
<table><tr><th>subject</th><th>group</th><th>mode</th><th>acked</th>
<th>unacked past {words.fmt_seconds(info.ack_threshold_s)}</th><th>dead letters</th>
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
        f"{words.fmt_seconds(info.ack_threshold_s)} ago, critical): {never['count']:,}</p>"
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


def _out_of_order_html(entry: Mapping[str, Any], kind: Disorder, meaning: str) -> str:
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
