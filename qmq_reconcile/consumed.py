"""The consumer-side check (``--consumed``): the outbox against one group's ``qmq_consumed``
rows, and what the group's tag filter settled without a row."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from qmq_reconcile.transforms import Window, as_utc, owners

UNCONSUMED_COLUMNS = ("message_id", "subject", "outbox", "created_at", "sent_at")
CONSUMED_ONLY_COLUMNS = ("message_id", "consumed_at")


def unconsumed(
    outbox: DataFrame,
    consumed: DataFrame,
    *,
    window: Window,
    subjects: Sequence[str],
    sent_before: datetime,
    filtered: DataFrame | None = None,
) -> DataFrame:
    """Messages committed but never consumed (``UNCONSUMED_COLUMNS``): outbox rows ``sent``
    to one of ``subjects``, created in the window and settled, sent before ``sent_before``
    (time enough to be consumed), with no ``done`` row of the group in ``consumed``
    (``readers.read_consumed``) and not among the ids in ``filtered`` (the
    group's tag filter skipped them: ``tag_filtered``). Each message once, however many
    outbox rows it has."""
    created = F.col("created_at")
    due = F.coalesce(F.col("deliver_at"), created)
    sent = outbox.where(
        (F.col("status") == "sent")
        & F.col("subject").isin(list(subjects))
        & window.created_in_range(created)
        & window.settled(created, due)
        & (F.col("sent_at") < F.lit(as_utc(sent_before)))
    )
    if filtered is not None:
        sent = sent.join(filtered, "message_id", "left_anti")
    first = F.min(F.struct("created_at", "subject", "outbox", "sent_at"))
    return (
        sent.join(consumed.select("message_id"), "message_id", "left_anti")
        .groupBy("message_id")
        .agg(first.alias("m"))
        .select("message_id", "m.subject", "m.outbox", "m.created_at", "m.sent_at")
    )


def tag_filtered(
    messages: DataFrame, actions: DataFrame, *, group: str, subjects: Sequence[str]
) -> DataFrame:
    """``message_id`` of the stored messages of ``subjects`` that ``group``'s tag filter
    skips (``owners``' ``tag_filter``: none of their tags in it): settled for the group,
    which never consumes them."""
    filters = (
        owners(actions)
        .where(
            (F.col("group") == group)
            & F.col("subject").isin(list(subjects))
            & (F.size("tag_filter") > 0)
        )
        .select("broker", "subject", "tag_filter")
        .distinct()
    )
    tags = F.coalesce(F.col("tags"), F.array().cast("array<string>"))
    return (
        messages.where(~F.col("command"))
        .join(F.broadcast(filters), ["broker", "subject"])
        .where(~F.arrays_overlap(tags, F.col("tag_filter")))
        .select(F.col("id").alias("message_id"))
        .distinct()
    )


def consumed_without_outbox(outbox: DataFrame, consumed: DataFrame, *, window: Window) -> DataFrame:
    """Messages the group consumed that no outbox row stands for (``CONSUMED_ONLY_COLUMNS``),
    consumed in the window, settled, and not before the oldest outbox row was created
    (what was consumed earlier may have had its row purged by the compensator's
    retention). Only an error when the reconciled outboxes are all that feed the group's
    subjects: ``qmq_consumed`` does not say which subject or producer a message had."""
    oldest = outbox.agg(F.min("created_at").alias("oldest"))
    at = F.col("consumed_at")
    return (
        consumed.join(outbox.select("message_id"), "message_id", "left_anti")
        .crossJoin(F.broadcast(oldest))
        .where(window.created_in_range(at) & window.settled(at, at) & (at >= F.col("oldest")))
        .select(*CONSUMED_ONLY_COLUMNS)
    )
