"""Unreadable regions of broker segments, parted from the records they were read with.

The job reads both logs with ``qmq-log``'s ``unreadable=true`` (``datasource.with_unreadable``),
so one pass over the files gives the records and the damage. ``records`` and ``regions``
split such a read again; like ``transforms``, they are pure functions of DataFrames.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from qmq_reconcile.datasource import UNREADABLE_FIELD

NAME = "unreadable_in_broker"  # the Parquet folder and the summary.json key
REGION_COLUMNS = ("broker", "log", "segment", "offset", "length")
_MARK = UNREADABLE_FIELD.name


def records(read: DataFrame) -> DataFrame:
    """The records of a read with ``unreadable=true``: the region rows and column dropped."""
    return read.where(F.col(_MARK).isNull()).drop(_MARK)


def _regions_of(read: DataFrame, log: str) -> DataFrame:
    return read.where(F.col(_MARK).isNotNull()).select(
        "broker",
        F.lit(log).alias("log"),
        *(F.col(f"{_MARK}.{name}").alias(name) for name in REGION_COLUMNS[2:]),
    )


def regions(messages: DataFrame, actions: DataFrame) -> DataFrame:
    """``REGION_COLUMNS``: one row per damaged region of the message and action logs
    (``log`` says which), from reads with ``unreadable=true``."""
    return _regions_of(messages, "messages").unionByName(_regions_of(actions, "actions"))


def totals(read: DataFrame, *more: Column) -> DataFrame:
    """``count, bytes``: how many regions a read with ``unreadable=true`` holds and how long
    they are, and ``more`` aggregates over the same rows (one row; reading it also fills
    the read's cache when it is persisted)."""
    length = F.col(f"{_MARK}.length")
    return read.agg(
        F.count(_MARK).alias("count"), F.coalesce(F.sum(length), F.lit(0)).alias("bytes"), *more
    )
