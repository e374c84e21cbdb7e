"""``report.txt``: the summary document rendered for a terminal (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qmq_reconcile.report import words
from qmq_reconcile.report.summary import (
    ACKED_OUT_OF_ORDER,
    CONSUMED,
    CONSUMED_WITHOUT_OUTBOX,
    NEVER_CONSUMED,
    OUT_OF_ORDER,
    OUT_OF_ORDER_SEVERITY,
    SEVERITY,
    UNREADABLE_SEVERITY,
    RunInfo,
)
from qmq_reconcile.transforms import (
    CATEGORIES,
    CRITICAL,
)
from qmq_reconcile.unreadable import NAME as UNREADABLE


def render_text(doc: Mapping[str, Any], info: RunInfo) -> str:
    lines = [
        f"qmq reconcile  {words.fmt_time(info.started_at)}",
        f"outboxes:     {', '.join(info.outboxes)}",
        f"broker data:  {', '.join(info.broker_dirs) or '(none: categories not judged)'}",
        "checked:      outbox rows and broker messages "
        + words.created_words(info.since, info.until),
        f"not judged:   {words.in_flight_words(info)}",
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
    lines += ["", f"consumer groups (unacked past {words.fmt_seconds(info.ack_threshold_s)})"]
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
        cells = "".join(f"{words.fmt_ms(s[k]):>12}" for k in ("p50", "p90", "p99", "max"))
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
        f"(sent more than {words.fmt_seconds(info.ack_threshold_s)} ago)",
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
        "{subject} key {key}: {message_id} (outbox id {outbox_id}) stored after {after_id} "
        "(outbox id {after_outbox_id}), {broker}{partition} seq {seq}"
    ).format_map({**message, "partition": partition})


def _acked_out_of_order_text(message: Mapping[str, Any]) -> str:
    return (
        "{subject} group {group} key {key}: {message_id} ({broker} partition {partition} seq "
        "{seq}) acked at {acked_at}, before {earlier_id} stored ahead of it (acked at "
        "{earlier_acked_at})"
    ).format_map(message)


def _region_text(region: Mapping[str, Any]) -> str:
    return "{broker} {log} segment {segment} offset {offset} length {length}".format_map(region)


# --- HTML -----------------------------------------------------------------------------------
