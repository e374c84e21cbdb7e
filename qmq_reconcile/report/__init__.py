"""The reconciliation's outputs: ``summary.json``, Parquet per category, text and HTML reports.

``summary`` builds the ``summary.json`` document (docs/architecture.md, section 7) from
collected results (``report.summary``); ``render_text`` (``report.text``) and
``render_html`` (``report.page``) are pure; ``report.output`` holds the only functions that
touch the output directory. The classified messages are written in one pass, partitioned by
category, into ``out/_categories`` and then moved to ``out/<category>/``; unreadable regions
of broker segments go to ``out/unreadable_in_broker/``, messages stored out of their outbox
order to ``out/out_of_order/``, messages a group acked out of their stored order to
``out/out_of_order_acked/``.
"""

from qmq_reconcile.report.output import (
    prepare_out,
    publish_categories,
    stage_categories,
    write_acked_out_of_order,
    write_consumed,
    write_out_of_order,
    write_reports,
    write_unreadable,
)
from qmq_reconcile.report.page import render_html
from qmq_reconcile.report.summary import (
    LISTED_OUT_OF_ORDER,
    LISTED_REGIONS,
    RunInfo,
    acked_entry,
    consumed_entry,
    exit_code,
    out_of_order_entry,
    summary,
    unreadable_entry,
)
from qmq_reconcile.report.text import render_text

__all__ = [
    "LISTED_OUT_OF_ORDER",
    "LISTED_REGIONS",
    "RunInfo",
    "acked_entry",
    "consumed_entry",
    "exit_code",
    "out_of_order_entry",
    "prepare_out",
    "publish_categories",
    "render_html",
    "render_text",
    "stage_categories",
    "summary",
    "unreadable_entry",
    "write_acked_out_of_order",
    "write_consumed",
    "write_out_of_order",
    "write_reports",
    "write_unreadable",
]
