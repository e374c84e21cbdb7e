"""The reconciliation's logic: pure functions from DataFrames to DataFrames.

Inputs (see ``readers`` and ``datasource``): outbox rows (``readers.OUTBOX_COLUMNS``),
broker message records (``datasource.MESSAGE_SCHEMA``) and action records, one row per seq
(``datasource.ACTION_SCHEMA``). Nothing here reads, writes or collects.

Every message id lands in at most one category; the first rule that matches wins:

1. ``duplicate_in_broker``: stored more than once (any broker, any subject);
2. ``body_mismatch``: an outbox row and a stored record whose body hashes differ;
3. ``dead_in_outbox``: the outbox row is ``dead`` (stored or not: the compensator gave up);
4. ``delivered``: ``sent`` and stored;
5. ``pending_but_stored``: ``pending`` and stored (mark-sent was lost);
6. ``missing_in_broker``: ``sent`` and not stored;
7. ``stuck_pending``: ``pending`` and not stored;
8. ``orphan_in_broker``: stored, no outbox row, from a reconciled producer.

A message is judged only inside the window: its ``created_at`` (the outbox row's, else the
broker's) in ``[since, until)``, and created and due (``deliver_at``) at least ``grace``
before the run. Younger ones are still in flight. Broker messages without an outbox row
from producers that are not reconciled belong to other services and are not judged at all
(not even as duplicates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

CATEGORIES = (
    "delivered",
    "missing_in_broker",
    "stuck_pending",
    "pending_but_stored",
    "dead_in_outbox",
    "orphan_in_broker",
    "body_mismatch",
    "duplicate_in_broker",
)
CRITICAL = frozenset(
    {"missing_in_broker", "orphan_in_broker", "body_mismatch", "duplicate_in_broker"}
)
LATENCY_METRICS = ("created_to_stored", "stored_to_acked")
PERCENTILES = (0.5, 0.9, 0.99)
# Upper bounds (ms) of the latency histogram's buckets; the last bucket is open-ended.
HISTOGRAM_BOUNDS_MS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 300_000,
    3_600_000,
)  # fmt: skip
CLASSIFIED_COLUMNS = (
    "message_id",
    "category",
    "subject",
    "producer",
    "status",
    "outbox",
    "outbox_rows",
    "brokers",
    "broker_copies",
    "outbox_sha256",
    "broker_sha256",
    "created_at",
    "stored_at",
    "sent_at",
    "deliver_at",
)
_OWNER = ("broker", "subject", "group", "state")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """Which messages are judged: created in ``[since, until)``, and older than ``grace``."""

    now: datetime
    grace: timedelta = timedelta(minutes=5)
    since: datetime | None = None
    until: datetime | None = None

    @property
    def settled_before(self) -> datetime:
        """Messages created or due after this are too young to judge."""
        return _utc(self.now) - self.grace

    def created_in_range(self, created: Column) -> Column:
        condition = created.isNotNull()
        if self.since is not None:
            condition &= created >= F.lit(_utc(self.since))
        if self.until is not None:
            condition &= created < F.lit(_utc(self.until))
        return condition

    def settled(self, created: Column, due: Column) -> Column:
        return F.greatest(created, due) < F.lit(self.settled_before)


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def _ms_between(start: Column, end: Column) -> Column:
    return (F.unix_micros(end) - F.unix_micros(start)) / F.lit(1000.0)


# --- categories ---------------------------------------------------------------------------


def _null(type_name: str) -> Column:
    return F.lit(None).cast(type_name)


def by_message_id(outbox: DataFrame, messages: DataFrame) -> DataFrame:
    """Outbox rows and broker records side by side, one row per message id.

    One shuffle: both inputs are unioned and grouped together (rather than grouped each
    and then full-outer-joined). The outbox side is its first row by (outbox, row id); an
    id with no row has ``outbox_rows`` null, one never stored ``broker_copies`` null.
    """
    # min() of a struct compares field by field: the first row by (outbox, row id).
    first = F.struct(
        "outbox", "row_id", "subject", "producer", "status", "created_at", "sent_at", "deliver_at"
    )
    rows = outbox.select(
        "message_id",
        first.alias("o"),
        F.col("body_sha256").alias("o_sha256"),
        *(_null(t).alias(c) for c, t in _BROKER_SIDE),
    )
    stored = messages.select(
        F.col("id").alias("message_id"),
        _null(rows.schema["o"].dataType.simpleString()).alias("o"),
        _null("string").alias("o_sha256"),
        *(F.col(c.removeprefix("b_")).alias(c) for c, _ in _BROKER_SIDE),
    )
    grouped = (
        rows.unionByName(stored)
        .groupBy("message_id")
        .agg(
            F.nullif(F.count("o"), F.lit(0)).alias("outbox_rows"),
            F.nullif(F.count("b_broker"), F.lit(0)).alias("broker_copies"),
            F.min("o").alias("o"),
            F.array_sort(F.collect_set("o_sha256")).alias("outbox_sha256"),
            F.array_sort(F.collect_set("b_broker")).alias("brokers"),
            F.array_sort(F.collect_set("b_body_sha256")).alias("broker_sha256"),
            F.min("b_subject").alias("b_subject"),
            F.min("b_producer").alias("b_producer"),
            F.min("b_created_at").alias("b_created_at"),
            F.max("b_deliver_at").alias("b_deliver_at"),
            F.min("b_stored_at").alias("stored_at"),
        )
    )
    return grouped.select("*", "o.*").drop("o", "row_id")


_BROKER_SIDE = (
    ("b_broker", "string"),
    ("b_body_sha256", "string"),
    ("b_subject", "string"),
    ("b_producer", "string"),
    ("b_created_at", "timestamp"),
    ("b_deliver_at", "timestamp"),
    ("b_stored_at", "timestamp"),
)


def _category(has_row: Column, stored: Column, reconciled: Column) -> Column:
    status = F.col("status")
    hashes = F.size(F.array_union("outbox_sha256", "broker_sha256"))
    in_scope = has_row | (stored & reconciled)
    return F.when(
        in_scope,
        F.when(F.col("broker_copies") > 1, "duplicate_in_broker")
        .when(has_row & stored & (hashes > 1), "body_mismatch")
        .when(has_row & (status == "dead"), "dead_in_outbox")
        .when(has_row & stored & (status == "sent"), "delivered")
        .when(has_row & stored & (status == "pending"), "pending_but_stored")
        .when(has_row & (status == "sent"), "missing_in_broker")
        .when(has_row & (status == "pending"), "stuck_pending")
        .when(~has_row & stored, "orphan_in_broker"),
    )


def classify(
    outbox: DataFrame,
    messages: DataFrame,
    *,
    window: Window,
    producers: Sequence[str] | None = None,
) -> DataFrame:
    """Each judged message id with its category (``CLASSIFIED_COLUMNS``).

    ``producers``: whose broker messages need an outbox row (orphans); ``None`` means the
    producers found in the outbox rows.
    """
    joined = by_message_id(outbox, messages)
    if producers is None:
        known = (
            outbox.where(F.col("producer").isNotNull())
            .select(F.col("producer").alias("b_producer"))
            .distinct()
            .withColumn("reconciled", F.lit(True))
        )
        joined = joined.join(F.broadcast(known), "b_producer", "left")
        reconciled = F.coalesce(F.col("reconciled"), F.lit(False))
    else:
        reconciled = F.col("b_producer").isin(list(producers)) if producers else F.lit(False)
    has_row = F.col("outbox_rows").isNotNull()
    stored = F.col("broker_copies").isNotNull()
    created = F.coalesce(F.col("created_at"), F.col("b_created_at"))
    due = F.coalesce(F.col("deliver_at"), F.col("b_deliver_at"), created)
    judged = window.created_in_range(created) & window.settled(created, due)
    return (
        joined.where(judged)
        .select(
            "*",
            _category(has_row, stored, reconciled).alias("category"),
            F.coalesce("subject", "b_subject").alias("_subject"),
            F.coalesce("producer", "b_producer").alias("_producer"),
            created.alias("_created_at"),
            F.coalesce("outbox_rows", F.lit(0)).alias("_outbox_rows"),
            F.coalesce("broker_copies", F.lit(0)).alias("_broker_copies"),
        )
        .where(F.col("category").isNotNull())
        .select(
            "message_id",
            "category",
            F.col("_subject").alias("subject"),
            F.col("_producer").alias("producer"),
            "status",
            "outbox",
            F.col("_outbox_rows").alias("outbox_rows"),
            F.coalesce("brokers", F.array().cast("array<string>")).alias("brokers"),
            F.col("_broker_copies").alias("broker_copies"),
            F.coalesce("outbox_sha256", F.array().cast("array<string>")).alias("outbox_sha256"),
            F.coalesce("broker_sha256", F.array().cast("array<string>")).alias("broker_sha256"),
            F.col("_created_at").alias("created_at"),
            "stored_at",
            "sent_at",
            "deliver_at",
        )
    )


def category_counters() -> list[Column]:
    """One count per category (named after it), for aggregating or observing classified
    rows."""
    return [F.count_if(F.col("category") == name).alias(name) for name in CATEGORIES]


# --- consumer groups ------------------------------------------------------------------------

# A seq is a dead letter when its latest dead/redrive/ack event is ``dead`` (events at the
# same time rank dead < redrive < ack). The event is coded in one long, time in µs * 4 +
# rank, so that a plain ``max`` finds it: a hash aggregate, no sort.
_RANKS = 4
_DEAD_RANK = 0


def _event_code(type_: Column, at: Column) -> Column:
    rank = F.when(type_ == "dead", 0).when(type_ == "redrive", 1).when(type_ == "ack", 2)
    return F.coalesce(F.unix_micros(at), F.lit(-1)) * _RANKS + rank


def owners(actions: DataFrame) -> DataFrame:
    """Every state owner (``broker, subject, group, state``) with its ``start_seq``: its
    ``group`` record's start cursor, else 0."""
    start = F.min(F.when(F.col("type") == "group", F.col("start_seq")))
    return actions.groupBy(*_OWNER).agg(F.coalesce(start, F.lit(0)).alias("start_seq"))


def owner_seqs(messages: DataFrame, actions: DataFrame) -> DataFrame:
    """One row per state owner and seq that is stored (for that owner's subject) or has an
    ack, dead or redrive event: ``broker, subject, group, state, seq, start_seq, stored,
    created_at, stored_at, acked, acked_at`` (the first ack), ``dead`` (a dead letter now);
    and one row per owner with a null seq, so that an owner with neither still counts.

    The owners' stored messages and the action rows are aggregated together in one pass
    (no join between them); ``group_stats`` and ``latency_samples`` count from it.
    """
    found = owners(actions)
    stored = messages.select("broker", "subject", "seq", "created_at", "stored_at").join(
        F.broadcast(found), ["broker", "subject"]
    )
    type_ = F.col("type")
    events = actions.where(F.col("seq").isNotNull() & type_.isin("ack", "dead", "redrive"))
    no_time = _null("timestamp")
    rows = (
        stored.select(
            *_OWNER,
            "seq",
            "start_seq",
            F.lit(True).alias("stored"),
            "created_at",
            "stored_at",
            F.lit(False).alias("ack"),
            no_time.alias("ack_at"),
            _null("long").alias("event"),
        )
        .unionByName(
            events.select(
                *_OWNER,
                "seq",
                _null("long").alias("start_seq"),
                F.lit(False).alias("stored"),
                no_time.alias("created_at"),
                no_time.alias("stored_at"),
                (type_ == "ack").alias("ack"),
                F.when(type_ == "ack", F.col("at")).alias("ack_at"),
                _event_code(type_, F.col("at")).alias("event"),
            )
        )
        .unionByName(
            found.select(
                *_OWNER,
                _null("long").alias("seq"),
                "start_seq",
                F.lit(False).alias("stored"),
                no_time.alias("created_at"),
                no_time.alias("stored_at"),
                F.lit(False).alias("ack"),
                no_time.alias("ack_at"),
                _null("long").alias("event"),
            )
        )
    )
    latest = F.pmod(F.max("event"), F.lit(_RANKS))
    return rows.groupBy(*_OWNER, "seq").agg(
        F.max("start_seq").alias("start_seq"),
        F.max("stored").alias("stored"),
        F.min("created_at").alias("created_at"),
        F.min("stored_at").alias("stored_at"),
        F.max("ack").alias("acked"),
        F.min("ack_at").alias("acked_at"),
        F.coalesce(latest == _DEAD_RANK, F.lit(False)).alias("dead"),
    )


def group_stats(
    messages: DataFrame,
    actions: DataFrame,
    *,
    now: datetime,
    ack_threshold: timedelta,
    window: Window | None = None,
    seqs: DataFrame | None = None,
) -> DataFrame:
    """Per ``subject, group``: ``mode, acked, unacked_past_threshold, dead_letters,
    never_acked`` over all brokers.

    A message is due for a group (in broadcast mode: for each of its consumers) when it was
    stored more than ``ack_threshold`` before ``now``, at or after the group's start seq
    (and created in ``window``); unacked = due - acked among them - dead-lettered among
    them. One aggregation of ``seqs`` (``owner_seqs``, computed when not given).
    """
    seqs = seqs if seqs is not None else owner_seqs(messages, actions)
    due = (
        F.col("stored")
        & (F.col("stored_at") < F.lit(_utc(now) - ack_threshold))
        & (F.col("seq") >= F.col("start_seq"))
    )
    if window is not None:
        due &= window.created_in_range(F.col("created_at"))
    acked, dead = F.col("acked"), F.col("dead")
    return seqs.groupBy("subject", "group").agg(
        F.when(F.max(F.length("state")) > 0, "broadcast").otherwise("shared").alias("mode"),
        F.count_if(acked).alias("acked"),
        (F.count_if(due) - F.count_if(due & acked) - F.count_if(due & dead)).alias(
            "unacked_past_threshold"
        ),
        F.count_if(dead).alias("dead_letters"),
        (F.count_if(acked) == 0).alias("never_acked"),
    )


# --- latency ------------------------------------------------------------------------------


def latency_samples(
    messages: DataFrame,
    actions: DataFrame,
    *,
    window: Window | None = None,
    seqs: DataFrame | None = None,
) -> DataFrame:
    """``metric, ms``: created→stored per stored message, stored→acked per first ack of a
    stored message by each state owner (``seqs``: ``owner_seqs``, computed when not given)."""
    seqs = seqs if seqs is not None else owner_seqs(messages, actions)
    stored = messages.where(F.col("stored_at").isNotNull())
    acked = seqs.where(F.col("stored") & F.col("acked"))
    if window is not None:
        stored = stored.where(window.created_in_range(F.col("created_at")))
        acked = acked.where(window.created_in_range(F.col("created_at")))
    created_to_stored = stored.select(
        F.lit("created_to_stored").alias("metric"),
        _ms_between(F.col("created_at"), F.col("stored_at")).alias("ms"),
    )
    stored_to_acked = acked.select(
        F.lit("stored_to_acked").alias("metric"),
        _ms_between(F.col("stored_at"), F.col("acked_at")).alias("ms"),
    )
    return created_to_stored.unionByName(stored_to_acked)


def latency_stats(samples: DataFrame, *, accuracy: int = 10_000) -> DataFrame:
    """``metric, count, p50, p90, p99, max`` in milliseconds (``percentile_approx``) and
    ``histogram``: the samples per bucket, bucket ``i`` below ``HISTOGRAM_BOUNDS_MS[i]``
    (and at or above the bound before it), the last one open-ended. One aggregation."""
    approx = F.percentile_approx("ms", list(PERCENTILES), accuracy)
    ms = F.col("ms")
    lower = (None, *HISTOGRAM_BOUNDS_MS)
    upper = (*HISTOGRAM_BOUNDS_MS, None)
    buckets = []
    for low, high in zip(lower, upper, strict=True):
        condition = ms.isNotNull()
        if low is not None:
            condition &= ms >= low
        if high is not None:
            condition &= ms < high
        buckets.append(F.count_if(condition))
    return (
        samples.groupBy("metric")
        .agg(
            F.count(F.lit(1)).alias("count"),
            approx.alias("p"),
            F.max("ms").alias("max"),
            F.array(*buckets).alias("histogram"),
        )
        .select(
            "metric",
            "count",
            F.col("p")[0].alias("p50"),
            F.col("p")[1].alias("p90"),
            F.col("p")[2].alias("p99"),
            "max",
            "histogram",
        )
    )
