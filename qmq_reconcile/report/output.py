"""The only code that touches the output directory: category folders staged and moved
into place, the Parquet folders of the checks, and the report files."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from qmq_reconcile.report.summary import (
    ACKED,
    ACKED_OUT_OF_ORDER,
    CONSUMED_WITHOUT_OUTBOX,
    LISTED_CONSUMED,
    LISTED_OUT_OF_ORDER,
    LISTED_REGIONS,
    NEVER_CONSUMED,
    OUT_OF_ORDER,
    STORED,
    Disorder,
    acked_entry,
    unreadable_entry,
)
from qmq_reconcile.transforms import (
    CATEGORIES,
    category_counters,
)
from qmq_reconcile.unreadable import NAME as UNREADABLE
from qmq_reconcile.unreadable import REGION_COLUMNS

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
    return _write_disorder(rows, out, STORED)


def write_acked_out_of_order(rows: DataFrame, out: Path) -> dict[str, Any]:
    """Write the messages acked out of order (``transforms.acked_out_of_order``) to
    ``out/out_of_order_acked/`` (removed again when there are none); returns their
    ``acked_entry``."""
    return acked_entry(*_write_disorder(rows, out, ACKED))


def _write_disorder(
    rows: DataFrame, out: Path, kind: Disorder
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
