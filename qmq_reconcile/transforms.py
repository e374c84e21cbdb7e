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

Ordered subjects: the broker stores physical partition p of subject S as a log ``S#p``; the
readers give its records ``subject`` S and ``partition`` p, so every result is by subject
(a group's partitions are summed). Command messages (``command``: the records a route change
appends to the partitions it closes) are not messages: they are in no category, no group
count and no latency, and the acks that consume them are not counted either.

Besides the categories, ``out_of_order`` finds messages stored in another order than their
outbox ids' within their outbox, subject and key, and ``acked_out_of_order`` messages of an
ordered subject that a group acked before a message of the same key stored ahead of them
(counters, not categories).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import Window as W
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
# A state owner: a group (or a broadcast consumer) on one log, a partition's for an ordered
# subject; its seqs are that log's.
_OWNER = ("broker", "subject", "partition", "group", "state")
_LOG = ("broker", "subject", "partition")
OUT_OF_ORDER_COLUMNS = (
    "subject",
    "key",
    "message_id",
    "outbox",
    "outbox_id",
    "broker",
    "partition",
    "seq",
    "stored_at",
    "after_id",
    "after_outbox_id",
)
ACKED_OUT_OF_ORDER_COLUMNS = (
    "subject",
    "group",
    "key",
    "message_id",
    "broker",
    "partition",
    "seq",
    "stored_at",
    "acked_at",
    "earlier_id",
    "earlier_acked_at",
)


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
        return as_utc(self.now) - self.grace

    def created_in_range(self, created: Column) -> Column:
        condition = created.isNotNull()
        if self.since is not None:
            condition &= created >= F.lit(as_utc(self.since))
        if self.until is not None:
            condition &= created < F.lit(as_utc(self.until))
        return condition

    def settled(self, created: Column, due: Column) -> Column:
        return F.greatest(created, due) < F.lit(self.settled_before)


def as_utc(value: datetime) -> datetime:
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
    # Partitioned by id before grouping, so the aggregation sorts once, after the shuffle:
    # grouped where they are read, the rows would be sorted and their sets serialised for
    # nothing (an id's outbox row and broker record are never in the same input partition).
    # Grouped by the id's hash first: the sort then orders by a long, whatever prefix the
    # ids share ("order-00001..."), and compares two ids' text only when their hashes tie.
    grouped = (
        rows.unionByName(stored)
        .repartition("message_id")
        .groupBy(F.xxhash64("message_id").alias("id_hash"), "message_id")
        .agg(
            F.nullif(F.count("o"), F.lit(0)).alias("outbox_rows"),
            F.nullif(F.count("b_broker"), F.lit(0)).alias("broker_copies"),
            F.min("o").alias("o"),
            F.sort_array(F.collect_set("o_sha256")).alias("outbox_sha256"),
            F.sort_array(F.collect_set("b_broker")).alias("brokers"),
            F.sort_array(F.collect_set("b_body_sha256")).alias("broker_sha256"),
            F.min("b_subject").alias("b_subject"),
            F.min("b_producer").alias("b_producer"),
            F.min("b_created_at").alias("b_created_at"),
            F.max("b_deliver_at").alias("b_deliver_at"),
            F.min("b_stored_at").alias("stored_at"),
        )
    )
    return grouped.select("*", "o.*").drop("id_hash", "o", "row_id")


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
    # More than one hash between the two sets, unless each holds one and it is the same
    # (``get``: null past the end, where indexing fails in ANSI mode).
    outbox_sha, broker_sha = F.col("outbox_sha256"), F.col("broker_sha256")
    differ = (
        (F.size(outbox_sha) > 1)
        | (F.size(broker_sha) > 1)
        | (F.get(outbox_sha, 0) != F.get(broker_sha, 0))
    )
    in_scope = has_row | (stored & reconciled)
    return F.when(
        in_scope,
        F.when(F.col("broker_copies") > 1, "duplicate_in_broker")
        .when(has_row & stored & differ, "body_mismatch")
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
    producers found in the outbox rows. Command messages are left out.
    """
    joined = by_message_id(outbox, messages.where(~F.col("command")))
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
    """Every state owner (``broker, subject, partition, group, state``) with its ``owner``
    key (``owner_key``), ``start_seq``: its ``group`` record's start cursor, else 0, and
    ``tag_filter``: the tags its latest ``group`` record with a filter fixed (null or
    empty: none)."""
    start = F.min(F.when(F.col("type") == "group", F.col("start_seq")))
    fixed = F.when((F.col("type") == "group") & F.col("tags").isNotNull(), F.col("at"))
    return actions.groupBy(*_OWNER).agg(
        owner_key().alias("owner"),
        F.coalesce(start, F.lit(0)).alias("start_seq"),
        F.max_by("tags", fixed).alias("tag_filter"),
    )


def owner_key() -> Column:
    """A state owner as one long: a 64-bit hash of ``broker, subject, partition, group,
    state``, so that seqs are grouped by two longs, not by five columns of text. Among ten
    thousand owners, two share a key with odds of about 3 in 10**12."""
    return F.xxhash64(*_OWNER)


def _stored_for_owners(messages: DataFrame, found: DataFrame) -> DataFrame:
    """``owner, seq, start_seq, command, created_at, stored_at, filtered``: each stored
    message once per state owner of its log (``partition`` is null on a plain subject's
    log, hence the null-safe comparison). ``filtered``: the owner's tag filter skipped it
    (none of its tags is in the filter), so the group never leases or acks it."""
    stored = messages.select(*_LOG, "seq", "command", "created_at", "stored_at", "tags").alias("m")
    owner = F.broadcast(found.alias("o"))
    same_log = (
        (F.col("m.broker") == F.col("o.broker"))
        & (F.col("m.subject") == F.col("o.subject"))
        & F.col("m.partition").eqNullSafe(F.col("o.partition"))
    )
    tag_filter = F.col("o.tag_filter")
    tags = F.coalesce(F.col("m.tags"), F.array().cast("array<string>"))
    filtered = F.coalesce(
        (F.size(tag_filter) > 0) & ~F.arrays_overlap(tags, tag_filter), F.lit(False)
    )
    return stored.join(owner, same_log).select(
        "o.owner",
        "m.seq",
        "o.start_seq",
        "m.command",
        "m.created_at",
        "m.stored_at",
        filtered.alias("filtered"),
    )


def owner_seqs(messages: DataFrame, actions: DataFrame) -> DataFrame:
    """One row per state owner (``owner``: ``owner_key``) and seq that is stored (for that
    owner's log) or has an ack, dead or redrive event: ``owner, seq, start_seq, stored,
    command, created_at, stored_at, acked, acked_at`` (the first ack), ``dead`` (a dead
    letter now), ``filtered`` (the owner's tag filter skipped it: settled without an ack);
    and one row per owner with a null seq, so that an owner with neither
    still counts. ``command``: the seq holds a command message (the broker acks it when it
    consumes it for the group), which the counts leave out.

    The owners' stored messages and the action rows are aggregated together in one pass
    (no join between them); ``group_stats`` and ``latency_samples`` count from it.
    """
    found = owners(actions)
    type_ = F.col("type")
    events = actions.where(F.col("seq").isNotNull() & type_.isin("ack", "dead", "redrive"))
    no_time = _null("timestamp")
    no_flag = _null("boolean")
    rows = (
        _stored_for_owners(messages, found)
        .select(
            "owner",
            "seq",
            "start_seq",
            F.lit(True).alias("stored"),
            "command",
            "created_at",
            "stored_at",
            F.lit(False).alias("ack"),
            no_time.alias("ack_at"),
            _null("long").alias("event"),
            "filtered",
        )
        .unionByName(
            events.select(
                owner_key().alias("owner"),
                "seq",
                _null("long").alias("start_seq"),
                F.lit(False).alias("stored"),
                no_flag.alias("command"),
                no_time.alias("created_at"),
                no_time.alias("stored_at"),
                (type_ == "ack").alias("ack"),
                F.when(type_ == "ack", F.col("at")).alias("ack_at"),
                _event_code(type_, F.col("at")).alias("event"),
                no_flag.alias("filtered"),
            )
        )
        .unionByName(
            found.select(
                "owner",
                _null("long").alias("seq"),
                "start_seq",
                F.lit(False).alias("stored"),
                no_flag.alias("command"),
                no_time.alias("created_at"),
                no_time.alias("stored_at"),
                F.lit(False).alias("ack"),
                no_time.alias("ack_at"),
                _null("long").alias("event"),
                no_flag.alias("filtered"),
            )
        )
    )
    latest = F.pmod(F.max("event"), F.lit(_RANKS))
    # Partitioned before grouping, so the rows of a seq meet in one aggregation after the
    # shuffle: grouped where they are read (stored messages and action records are never
    # in the same input partition), they would be hashed and shuffled without merging.
    return (
        rows.repartition("owner", "seq")
        .groupBy("owner", "seq")
        .agg(
            F.max("start_seq").alias("start_seq"),
            F.max("stored").alias("stored"),
            F.coalesce(F.max("command"), F.lit(False)).alias("command"),
            F.min("created_at").alias("created_at"),
            F.min("stored_at").alias("stored_at"),
            F.max("ack").alias("acked"),
            F.min("ack_at").alias("acked_at"),
            F.coalesce(latest == _DEAD_RANK, F.lit(False)).alias("dead"),
            F.coalesce(F.max("filtered"), F.lit(False)).alias("filtered"),
        )
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
    never_acked`` over all brokers and, for an ordered subject, all its partitions.

    A message is due for a group (in broadcast mode: for each of its consumers) when it was
    stored more than ``ack_threshold`` before ``now``, at or after the group's start seq
    (and created in ``window``), unless the group's tag filter skips it (settled for it);
    unacked = due - acked among them - dead-lettered among them. Command messages count
    nowhere. ``mode``: ``ordered`` on an ordered subject's partitions, else ``broadcast``
    or ``shared``. Counted per state owner from ``seqs`` (``owner_seqs``, computed when not
    given), then summed per subject and group.
    """
    seqs = seqs if seqs is not None else owner_seqs(messages, actions)
    message = ~F.col("command")
    due = (
        message
        & F.col("stored")
        & (F.col("stored_at") < F.lit(as_utc(now) - ack_threshold))
        & (F.col("seq") >= F.col("start_seq"))
        & ~F.col("filtered")  # skipped by the group's tag filter: settled, never acked
    )
    if window is not None:
        due &= window.created_in_range(F.col("created_at"))
    acked, dead = message & F.col("acked"), message & F.col("dead")
    per_owner = seqs.groupBy("owner").agg(
        F.count_if(acked).alias("acked"),
        (F.count_if(due) - F.count_if(due & acked) - F.count_if(due & dead)).alias("unacked"),
        F.count_if(dead).alias("dead_letters"),
    )
    mode = (
        F.when(F.count("partition") > 0, "ordered")
        .when(F.max(F.length("state")) > 0, "broadcast")
        .otherwise("shared")
    )
    found = owners(actions).select("owner", "subject", "partition", "group", "state")
    return (
        per_owner.join(F.broadcast(found), "owner")
        .groupBy("subject", "group")
        .agg(
            mode.alias("mode"),
            F.sum("acked").alias("acked"),
            F.sum("unacked").alias("unacked_past_threshold"),
            F.sum("dead_letters").alias("dead_letters"),
            (F.sum("acked") == 0).alias("never_acked"),
        )
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
    stored message by each state owner (``seqs``: ``owner_seqs``, computed when not given);
    command messages left out."""
    seqs = seqs if seqs is not None else owner_seqs(messages, actions)
    stored = messages.where(F.col("stored_at").isNotNull() & ~F.col("command"))
    acked = seqs.where(F.col("stored") & F.col("acked") & ~F.col("command"))
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


# Percentiles are read off the samples counted per value rounded to this many significant
# digits (HdrHistogram's precision): within 0.5% of the exact value.
SIGNIFICANT_DIGITS = 3


def latency_stats(samples: DataFrame) -> list[dict[str, Any]]:
    """Per metric: ``metric, count, p50, p90, p99, max`` in milliseconds and ``histogram``,
    the samples per bucket, bucket ``i`` below ``HISTOGRAM_BOUNDS_MS[i]`` (and at or above
    the bound before it), the last one open-ended.

    One hash aggregation counts the samples per metric, histogram bucket and value rounded
    to ``SIGNIFICANT_DIGITS`` (at most 900 values a decade); the percentiles (nearest rank)
    and the histogram are read off those counts here. Counts and ``max`` are exact, the
    percentiles within 0.5%. (``percentile_approx`` instead sorts every sample when the
    object hash aggregate is off, as it is for the classification.)
    """
    ms = F.col("ms")
    magnitude = F.floor(F.log10(F.abs(ms))).cast("int")
    digits = F.round(F.abs(ms) / F.pow(F.lit(10.0), magnitude - (SIGNIFICANT_DIGITS - 1)))
    bucket = F.lit(len(HISTOGRAM_BOUNDS_MS))
    for index, bound in reversed(list(enumerate(HISTOGRAM_BOUNDS_MS))):
        bucket = F.when(ms < bound, index).otherwise(bucket)
    counted = (
        samples.where(ms.isNotNull())
        .groupBy(
            "metric",
            bucket.alias("bucket"),
            F.when(ms == 0, 0).otherwise(magnitude).alias("magnitude"),
            F.when(ms == 0, 0).otherwise(F.signum(ms) * digits).cast("long").alias("digits"),
        )
        .agg(F.count(F.lit(1)).alias("n"), F.max(ms).alias("max"))
        .collect()
    )
    rows: dict[str, list[Any]] = {}
    for row in counted:
        rows.setdefault(row["metric"], []).append(row)
    return [_latency_row(metric, found) for metric, found in sorted(rows.items())]


def _latency_row(metric: str, counted: list[Any]) -> dict[str, Any]:
    histogram = [0] * (len(HISTOGRAM_BOUNDS_MS) + 1)
    values: dict[float, int] = {}
    for row in counted:
        histogram[row["bucket"]] += row["n"]
        value = _rounded(row["digits"], row["magnitude"])
        values[value] = values.get(value, 0) + row["n"]
    count = sum(histogram)
    ordered = sorted(values.items())
    percentiles = []
    for fraction in PERCENTILES:
        rank, seen = max(1, math.ceil(fraction * count)), 0
        for value, n in ordered:
            seen += n
            if seen >= rank:
                percentiles.append(value)
                break
    p50, p90, p99 = percentiles
    top = max(row["max"] for row in counted)
    return {
        "metric": metric,
        "count": count,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": top,
        "histogram": histogram,
    }


def _rounded(digits: int, magnitude: int) -> float:
    """``digits * 10 ** (magnitude - SIGNIFICANT_DIGITS + 1)``, as close as a float gets (a
    division by an exact power of ten, not a multiplication by an inexact one)."""
    shift = magnitude - (SIGNIFICANT_DIGITS - 1)
    return float(digits * 10**shift) if shift >= 0 else digits / 10**-shift


# --- order ------------------------------------------------------------------------------------


def out_of_order(outbox: DataFrame, messages: DataFrame, *, window: Window) -> DataFrame:
    """The messages stored out of their outbox order (``OUT_OF_ORDER_COLUMNS``).

    Per outbox, subject and key, a message is out of order when another message of that
    outbox, subject and key with a larger outbox id (``row_id``: an identity, increasing
    with insertion) was stored before it: a consumer reading in stored order met the newer
    one first. ``after_id`` and ``after_outbox_id`` name the largest such one. Stored order
    is by ``stored_at``, then broker, partition and seq: within one log that is seq order
    (the broker stamps ``stored_at`` as it allocates seqs), across the logs a key moved
    between when its partition was split, merged or moved it is the time each was stored.

    Judged: keyed messages with an outbox row, created in the window and settled, each at
    its first stored copy (a later copy is a ``duplicate_in_broker`` already). Ids are
    compared only within one outbox: two databases' ids say nothing about each other.
    Command messages have no key.
    """
    first = F.min(F.struct("stored_at", "broker", "partition", "seq", "subject", "key"))
    stored = (
        messages.where(F.col("key").isNotNull() & ~F.col("command"))
        .groupBy(F.col("id").alias("message_id"))
        .agg(first.alias("m"))
        .select("message_id", "m.*")
    )
    rows = outbox.select(
        "message_id",
        "outbox",
        F.col("row_id").alias("outbox_id"),
        F.col("created_at").alias("o_created_at"),
        F.col("deliver_at").alias("o_deliver_at"),
    )
    created = F.col("o_created_at")
    due = F.coalesce(F.col("o_deliver_at"), created)
    judged = stored.join(rows, "message_id").where(
        window.created_in_range(created) & window.settled(created, due)
    )
    return _overtaken(judged, ("outbox", "subject", "key"), "outbox_id", OUT_OF_ORDER_COLUMNS)


def acked_out_of_order(messages: DataFrame, actions: DataFrame, *, window: Window) -> DataFrame:
    """The messages of ordered subjects a group acked out of their stored order
    (``ACKED_OUT_OF_ORDER_COLUMNS``).

    Per subject, group and key, a message is acked out of order when a message of that key
    stored before it (stored order as in ``out_of_order``) was first acked after it was
    first acked: the group's handler met the later one first. ``earlier_id`` and
    ``earlier_acked_at`` name the last acked such one. The broker records an ack's time to
    the microsecond per ack request, so messages acked in one request are in order by
    definition (the consumer handled them in the order it was served them).

    Judged: keyed messages of ordered subjects (stored in a partition), created in the
    window, with an ack from the group. A message the group ever dead-lettered is left out:
    a dead letter skipped (``on_dead: skip``) and redriven later is acked after the ones
    behind it by design. Command messages have no key.
    """
    stored = messages.where(
        F.col("partition").isNotNull()
        & F.col("key").isNotNull()
        & ~F.col("command")
        & window.created_in_range(F.col("created_at"))
    ).select(*_LOG, "seq", "key", F.col("id").alias("message_id"), "stored_at")
    ordered_acts = actions.where(F.col("partition").isNotNull() & F.col("seq").isNotNull())
    owner_seq = (*_OWNER, "seq")
    acked = (
        ordered_acts.where(F.col("type") == "ack")
        .groupBy(*owner_seq)
        .agg(F.min("at").alias("acked_at"))
    )
    dead = ordered_acts.where(F.col("type") == "dead").select(*owner_seq).distinct()
    judged = acked.join(dead, list(owner_seq), "left_anti").join(stored, [*_LOG, "seq"])
    same_key = ("subject", "group", "state", "key")
    return _overtaken(judged, same_key, "acked_at", ACKED_OUT_OF_ORDER_COLUMNS)


def _overtaken(
    judged: DataFrame, same_key: Sequence[str], measure: str, columns: Sequence[str]
) -> DataFrame:
    """The rows of ``judged`` that a message stored before them (stored order: see
    ``out_of_order``) with the same ``same_key`` exceeds in ``measure``, as ``columns``: the
    last two name the largest such ``(measure, message_id)``, its id then its measure."""
    # The hash first, so that the window's sort compares longs across keys, not the
    # outbox URL (or subject) that every row shares.
    earlier = (
        W.partitionBy(F.xxhash64(*same_key), *same_key)
        .orderBy("stored_at", "broker", "partition", "seq")
        .rowsBetween(W.unboundedPreceding, -1)
    )
    before = F.max(F.struct(measure, "message_id")).over(earlier)
    *kept, as_id, as_measure = columns
    return (
        judged.select("*", before.alias("before"))
        .where(F.col(f"before.{measure}") > F.col(measure))
        .select(
            *kept,
            F.col("before.message_id").alias(as_id),
            F.col(f"before.{measure}").alias(as_measure),
        )
    )
