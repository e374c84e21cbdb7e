"""The reconciliation run: check inputs, read, classify, write (docs/architecture.md, section 7).

Inputs are checked before Spark starts, so a bad path or URL fails fast with a
``BadInput``. Each input is read once and cached, so every result of the run sees the
same snapshot of the outbox tables and broker files.

Stages (timed in ``Result.timings``, shown as they go through a ``progress.Progress``):
``start_spark`` and ``stop_spark`` (only for a session the run creates), ``read_broker``
and ``read_outbox`` (read and cache; the broker's records and the unreadable regions of
its segments in one pass), ``classify`` (the categories, computed once and written as
Parquet partitioned by category, counted as they are written; then, when the broker holds
keyed messages, the messages stored out of their outbox order), ``groups`` (group stats
and latency from one aggregation of stored messages and action records per state owner
and seq), ``write_outputs`` (category folders moved into place, the unreadable regions,
``summary.json``, ``report.txt``, ``report.html``). Two threads run them (``_pipelined``):
read broker then groups, and read outbox then (once the broker data is in) consumed and
classify.

A session the run creates on a local master maps its JVM's classes from a class-data
archive in ``jvm_cache`` (``qmq_reconcile.jvm_archive``); the first run writes it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Required, TypedDict, TypeVar, Unpack

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from qmq_reconcile import consumed as consumed_check
from qmq_reconcile import readers, report, session, transforms, unreadable
from qmq_reconcile.errors import (
    BadInput,
    BrokerDataUnreadable,
    ConsumedUnreadable,
    OutboxUnreadable,
    UnreadablePath,
)
from qmq_reconcile.jetstream import StreamRows, fetch_rows, read_streams, stream_sources
from qmq_reconcile.progress import Progress, stage

logger = logging.getLogger(__name__)

DEFAULT_GRACE = timedelta(minutes=5)
DEFAULT_ACK_THRESHOLD = timedelta(minutes=10)
DEFAULT_JVM_CACHE = session.default_jvm_cache()
JVM_LOG = "spark.log"
# Broker message segments up to this size make a small run (``session.local_conf``).
SMALL_RUN_BYTES = 16 * 2**20
STAGE_LABELS = {
    "start_spark": "starting Spark",
    "read_broker": "reading broker data",
    "read_outbox": "reading outbox tables",
    "classify": "classifying messages",
    "groups": "counting consumer groups and latency",
    "consumed": "checking what the consumer group handled",
    "write_outputs": "writing the reports",
    "stop_spark": "stopping Spark",
}
STAGES = tuple(STAGE_LABELS)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """A finished run: the summary document, the text report and seconds per stage."""

    summary: dict[str, Any]
    text: str
    timings: dict[str, float]
    out: Path

    @property
    def exit_code(self) -> int:
        code: int = self.summary["exit_code"]
        return code


class ReconcileOptions(TypedDict, total=False):
    """What ``reconcile`` takes: the inputs and the options of ``run`` users set."""

    outboxes: Required[Sequence[str]]
    broker_dirs: Required[Sequence[str]]
    out: Required[str | Path]
    master: str
    grace: timedelta
    since: datetime | None
    until: datetime | None
    producers: Sequence[str] | None
    ack_threshold: timedelta
    jars: Sequence[str] | None
    conf: Mapping[str, str] | None
    spark: SparkSession | None
    jetstream: str | None
    streams: Sequence[str]
    consumed: str | None
    group: str | None
    subjects: Sequence[str]


def reconcile(**options: Unpack[ReconcileOptions]) -> dict[str, Any]:
    """Reconcile outbox tables (SQLAlchemy URLs) with broker data directories and/or the
    ``streams`` of the NATS JetStream server at ``jetstream`` (``nats://host:port``); with
    ``consumed`` (the SQLAlchemy URL of a consumer's database), also which of the outbox's
    messages to ``subjects`` consumer ``group`` never handled (its ``qmq_consumed`` rows),
    which is all there is to check on a transport that cannot be read back (RabbitMQ).

    Writes ``summary.json``, ``report.txt``, ``report.html``, one Parquet folder per
    non-empty category and one of unreadable regions (if any) under ``out``, and returns
    the summary. Raises ``BadInput`` for an unreadable path or a bad URL. Runs in
    ``spark`` when given (left running), else in a new session on ``master`` with the JDBC
    driver ``jars`` (default: Debian's) and extra Spark ``conf`` (stopped at the end).
    Defaults are ``run``'s.
    """
    return run(**options).summary


def run(
    *,
    outboxes: Sequence[str],
    broker_dirs: Sequence[str],
    out: str | Path,
    master: str = "local[*]",
    grace: timedelta = DEFAULT_GRACE,
    since: datetime | None = None,
    until: datetime | None = None,
    producers: Sequence[str] | None = None,
    ack_threshold: timedelta = DEFAULT_ACK_THRESHOLD,
    jars: Sequence[str] | None = None,
    conf: Mapping[str, str] | None = None,
    spark: SparkSession | None = None,
    partitions: int | None = None,
    fetchsize: int = readers.DEFAULT_FETCHSIZE,
    now: datetime | None = None,
    jvm_log: bool = False,
    jvm_cache: Path | None = DEFAULT_JVM_CACHE,
    progress: Progress | None = None,
    jetstream: str | None = None,
    streams: Sequence[str] = (),
    consumed: str | None = None,
    group: str | None = None,
    subjects: Sequence[str] = (),
) -> Result:
    """``reconcile`` with the details: stage timings, JDBC partitions and fetch size, and
    the reference time ``now`` (default: the start of the run); ``jvm_log``: write a new
    session's JVM console output to ``spark.log`` under ``out``, not to stderr;
    ``jvm_cache``: where a new local session keeps its class-data archive (``None``: none);
    ``progress``: told when each stage starts and ends."""
    started = now or datetime.now(UTC)
    window = transforms.Window(now=started, grace=grace, since=since, until=until)
    sources, dirs, out_dir = _check_inputs(outboxes, broker_dirs, out, window)
    stream_list = stream_sources(jetstream, streams)
    consumer = _consumed_check(consumed, group, subjects)
    if not dirs and not stream_list and consumer is None:
        raise BadInput(
            "give at least one broker data directory, JetStream stream or --consumed database"
        )
    driver_jars = session.check_jars(session.default_jars() if jars is None else jars)
    # read before Spark starts: an unreachable server or a missing stream fails without a JVM
    stream_rows = fetch_rows(stream_list) if stream_list else None
    info = report.RunInfo(
        started_at=started,
        outboxes=[s.label for s in sources],
        broker_dirs=[*dirs, *(s.label for s in stream_list)],
        since=since,
        until=until,
        settled_before=window.settled_before,
        grace_s=grace.total_seconds(),
        ack_threshold_s=ack_threshold.total_seconds(),
        producers=list(producers) if producers is not None else None,
    )
    timings: dict[str, float] = {}

    def timed(name: str, label: str | None = None) -> AbstractContextManager[None]:
        return stage(progress, timings, name, label or STAGE_LABELS[name])

    owned = spark is None
    small = readers.segment_bytes(dirs, "messages") <= SMALL_RUN_BYTES
    if small and partitions is None:
        partitions = 1  # no bounds query, one JDBC read: the table is small too, or lopsided
    archive = None
    if spark is None:
        if jvm_cache is not None and master.startswith("local"):
            archive = session.class_archive(jvm_cache)
        with timed("start_spark", f"starting Spark ({master})"):
            spark = session.build_session(
                master=master,
                jars=driver_jars,
                conf=conf,
                jvm_log=out_dir / JVM_LOG if jvm_log else None,
                archive=archive,
                small=small,
            )
    active: SparkSession = spark
    cached: list[DataFrame] = []

    def read_broker() -> _Broker:
        with timed("read_broker"):
            return _read_broker(active, dirs, stream_rows, cached)

    def read_outbox() -> DataFrame:
        with timed("read_outbox"):
            return _read_outbox(active, sources, partitions, fetchsize, cached)

    def check_consumed(outbox: DataFrame, data: _Broker | None = None) -> dict[str, Any] | None:
        if consumer is None:
            return None
        with timed("consumed"):
            return _check_consumed(
                active,
                consumer,
                outbox,
                data,
                window=window,
                sent_before=started - ack_threshold,
                out=out_dir,
                cached=cached,
            )

    def classify(outbox: DataFrame, data: _Broker) -> tuple[dict[str, int], dict[str, Any]]:
        with timed("classify"):
            classified = transforms.classify(
                outbox, data.messages, window=window, producers=producers
            )
            counts = report.stage_categories(classified, out_dir)
            return counts, _out_of_order(outbox, data, window=window, out=out_dir)

    def groups_and_latency(data: _Broker) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        with timed("groups"):
            return _groups_and_latency(
                data, now=started, ack_threshold=ack_threshold, window=window, cached=cached
            )

    try:
        if not (dirs or stream_list):  # a consumer-side check alone (RabbitMQ): not judged
            outbox = read_outbox()
            report.prepare_out(out_dir)
            doc = report.summary({}, [], [], consumed=check_consumed(outbox), judged=False)
            with timed("write_outputs"):
                text = report.render_text(doc, info)
                report.write_reports(out_dir, doc, text, report.render_html(doc, info, {}))
        else:

            def judge(
                outbox: DataFrame, data: _Broker
            ) -> tuple[dict[str, Any] | None, tuple[dict[str, int], dict[str, Any]]]:
                report.prepare_out(out_dir)  # once both inputs were read
                return check_consumed(outbox, data), classify(outbox, data)

            (data, (groups, latency)), (checked, (counts, disorder)) = _pipelined(
                read_broker, read_outbox, after_broker=groups_and_latency, after_both=judge
            )
            with timed("write_outputs"):
                damage = report.write_unreadable(
                    data.regions, out_dir, count=data.damage_count, total_bytes=data.damage_bytes
                )
                doc = report.summary(counts, groups, latency, damage, disorder, checked)
                text = report.render_text(doc, info)
                page = report.render_html(doc, info, _histogram(latency))
                report.publish_categories(out_dir)
                report.write_reports(out_dir, doc, text, page)
    finally:
        for frame in cached:
            frame.unpersist()
        if owned:
            label = STAGE_LABELS["stop_spark"]
            if archive is not None and archive.writing is not None:
                label += " (and saving its class archive for faster starts: first run only)"
            with timed("stop_spark", label):
                session.stop_session(active, archive)
    logger.info(
        "reconciliation finished",
        extra={"action": "reconcile.finished", "exit_code": doc["exit_code"], **timings},
    )
    return Result(summary=doc, text=text, timings=timings, out=out_dir)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _ConsumedCheck:
    """``--consumed``: a consumer's database, its group and the subjects the group takes."""

    source: readers.JdbcSource
    group: str
    subjects: tuple[str, ...]


def _consumed_check(
    url: str | None, group: str | None, subjects: Sequence[str]
) -> _ConsumedCheck | None:
    if url is None:
        if group is not None or subjects:
            raise BadInput("--group and --subject go with --consumed URL")
        return None
    if group is None or not subjects:
        raise BadInput("--consumed needs --group NAME and at least one --subject NAME")
    if not readers.GROUP_NAME.match(group):
        raise BadInput(f"--group {group!r}: 1-200 of A-Z a-z 0-9 . _ - @")
    source = readers.jdbc_source(url)
    return _ConsumedCheck(source=source, group=group, subjects=tuple(dict.fromkeys(subjects)))


def _check_consumed(
    spark: SparkSession,
    check: _ConsumedCheck,
    outbox: DataFrame,
    broker: _Broker | None,
    *,
    window: transforms.Window,
    sent_before: datetime,
    out: Path,
    cached: list[DataFrame],
) -> dict[str, Any]:
    """The ``consumed`` entry of the summary, its messages written under ``out``. The group's
    rows are read once (cached): both comparisons use them, and see the same rows. With
    the ``broker``'s data, what the group's tag filter skipped is not unconsumed."""
    consumed = _cache(readers.read_consumed(spark, check.source, group=check.group), cached)
    filtered = None
    if broker is not None:
        filtered = consumed_check.tag_filtered(
            broker.messages, broker.actions, group=check.group, subjects=check.subjects
        )
    never = consumed_check.unconsumed(
        outbox,
        consumed,
        window=window,
        subjects=check.subjects,
        sent_before=sent_before,
        filtered=filtered,
    )
    extra = consumed_check.consumed_without_outbox(outbox, consumed, window=window)
    try:
        found_never, found_extra = report.write_consumed(never, extra, out)
    except readers.SPARK_ERRORS as exc:
        raise ConsumedUnreadable(
            f"consumer database {check.source.label}: {readers.first_line(exc)}"
        ) from exc
    return report.consumed_entry(
        database=check.source.label,
        group=check.group,
        subjects=check.subjects,
        never=found_never,
        without_outbox=found_extra,
    )


def _check_inputs(
    outboxes: Sequence[str],
    broker_dirs: Sequence[str],
    out: str | Path,
    window: transforms.Window,
) -> tuple[list[readers.JdbcSource], list[str], Path]:
    if not outboxes:
        raise BadInput("give at least one outbox URL")
    if window.since and window.until and window.since >= window.until:
        raise BadInput("--since must be before --until")
    sources = [readers.jdbc_source(url) for url in outboxes]
    dirs = [readers.check_broker_dir(str(d)) for d in dict.fromkeys(broker_dirs)]
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".qmq-reconcile-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UnreadablePath(f"output directory {out_dir} cannot be written: {exc}") from exc
    return sources, dirs, out_dir


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Broker:
    """The broker data of a run: records, unreadable regions and their totals, how many
    records are keyed messages (command messages have no key) and how many of those are
    in an ordered subject's partition."""

    messages: DataFrame
    actions: DataFrame
    regions: DataFrame
    damage_count: int
    damage_bytes: int
    keyed: int
    ordered: int


# Columns of the broker reads that no result uses: not cached.
_UNUSED = {"messages": ("segment", "offset"), "actions": ("error",)}


def _read_broker(
    spark: SparkSession,
    dirs: Sequence[str],
    stream_rows: StreamRows | None,
    cached: list[DataFrame],
) -> _Broker:
    def read(kind: str) -> DataFrame:
        frame = readers.read_broker(spark, dirs, kind)
        if kind == "messages" and stream_rows is not None:
            frame = frame.unionByName(read_streams(spark, stream_rows))
        return _cache(frame.drop(*_UNUSED[kind]), cached)

    read_messages, read_actions = read("messages"), read("actions")
    count, total_bytes, keyed, ordered = _materialise_broker(read_messages, read_actions)
    return _Broker(
        messages=unreadable.records(read_messages),
        actions=unreadable.records(read_actions),
        regions=unreadable.regions(read_messages, read_actions),
        damage_count=count,
        damage_bytes=total_bytes,
        keyed=keyed,
        ordered=ordered,
    )


def _read_outbox(
    spark: SparkSession,
    sources: Sequence[readers.JdbcSource],
    partitions: int | None,
    fetchsize: int,
    cached: list[DataFrame],
) -> DataFrame:
    outbox = readers.read_outboxes(spark, sources, partitions=partitions, fetchsize=fetchsize)
    outbox = _cache(outbox, cached)
    _materialise_outbox(outbox, sources)
    return outbox


def _out_of_order(
    outbox: DataFrame, broker: _Broker, *, window: transforms.Window, out: Path
) -> dict[str, Any]:
    """The ``out_of_order`` entry of the summary, its messages written under ``out``; with
    no keyed message in the broker data there is nothing to order and nothing to run, with
    none in an ordered subject no group's acks to check."""
    if not broker.keyed:
        return report.out_of_order_entry(0, 0, [])
    stored = transforms.out_of_order(outbox, broker.messages, window=window)
    acked = None
    if broker.ordered:
        acks = transforms.acked_out_of_order(broker.messages, broker.actions, window=window)
        acked = report.write_acked_out_of_order(acks, out)
    return report.out_of_order_entry(*report.write_out_of_order(stored, out), acked=acked)


def _groups_and_latency(
    broker: _Broker,
    *,
    now: datetime,
    ack_threshold: timedelta,
    window: transforms.Window,
    cached: list[DataFrame],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Group stats and latency rows, both counted from one ``owner_seqs`` (cached)."""
    messages, actions = broker.messages, broker.actions
    seqs = _cache(transforms.owner_seqs(messages, actions), cached)
    groups = transforms.group_stats(
        messages, actions, now=now, ack_threshold=ack_threshold, window=window, seqs=seqs
    )
    samples = transforms.latency_samples(messages, actions, window=window, seqs=seqs)
    return [r.asDict() for r in groups.collect()], transforms.latency_stats(samples)


A = TypeVar("A")
B = TypeVar("B")


def _together(first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
    """Run both at once, each on its own thread: Spark runs their jobs side by side, so
    the cores one leaves idle (planning, a last long task) take the other's tasks. The
    first error is raised once both have ended."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="reconcile") as pool:
        started = pool.submit(first), pool.submit(second)
        return started[0].result(), started[1].result()


def _pipelined(
    read_broker: Callable[[], _Broker],
    read_outbox: Callable[[], DataFrame],
    *,
    after_broker: Callable[[_Broker], A],
    after_both: Callable[[DataFrame, _Broker], B],
) -> tuple[tuple[_Broker, A], B]:
    """Two threads whose Spark jobs run side by side: one reads the broker data, then runs
    ``after_broker`` on it (the group counts need nothing else); the other reads the
    outbox, waits for the broker data, then runs ``after_both``. So the group counts start
    as soon as the broker data is in, whichever read ends first, and the cores do not idle
    through the longer read's last tasks. The first error
    is raised once both threads have ended; a failed outbox read skips ``after_broker``
    if it has not started."""
    broker_read: Future[_Broker] = Future()
    outbox_failed = threading.Event()

    def broker_side() -> tuple[_Broker, A | None]:
        try:
            data = read_broker()
        except BaseException as exc:
            broker_read.set_exception(exc)
            raise
        broker_read.set_result(data)
        return data, None if outbox_failed.is_set() else after_broker(data)

    def outbox_side() -> B:
        try:
            outbox = read_outbox()
        except BaseException:
            outbox_failed.set()
            raise
        return after_both(outbox, broker_read.result())

    (data, counted), judged = _together(broker_side, outbox_side)
    assert counted is not None  # the outbox side raised otherwise
    return (data, counted), judged


def _cache(frame: DataFrame, cached: list[DataFrame]) -> DataFrame:
    frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
    cached.append(frame)
    return frame


def _materialise_broker(messages: DataFrame, actions: DataFrame) -> tuple[int, int, int, int]:
    """Fill both caches (one job); how many unreadable regions they hold, how many bytes,
    how many keyed messages there are, and how many of them are in ordered subjects."""
    is_keyed = F.col("key").isNotNull() & ~F.col("command")
    keyed = F.count_if(is_keyed).alias("keyed")
    ordered = F.count_if(is_keyed & F.col("partition").isNotNull()).alias("ordered")
    none = F.lit(0).cast("long")
    both = unreadable.totals(messages, keyed, ordered).unionByName(
        unreadable.totals(actions, none.alias("keyed"), none.alias("ordered"))
    )
    try:
        found = both.collect()
    except readers.SPARK_ERRORS as exc:
        raise BrokerDataUnreadable(f"broker data: {readers.first_line(exc)}") from exc
    return (
        sum(int(row["count"]) for row in found),
        sum(int(row["bytes"]) for row in found),
        sum(int(row["keyed"]) for row in found),
        sum(int(row["ordered"]) for row in found),
    )


def _materialise_outbox(outbox: DataFrame, sources: Sequence[readers.JdbcSource]) -> None:
    try:
        outbox.count()
    except readers.SPARK_ERRORS as exc:
        labels = ", ".join(s.label for s in sources)
        raise OutboxUnreadable(f"outbox {labels}: {readers.first_line(exc)}") from exc


def _histogram(latency: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, int]]:
    """Per metric, the non-empty histogram buckets of ``latency_stats`` rows."""
    return {
        str(row["metric"]): {bucket: int(n) for bucket, n in enumerate(row["histogram"]) if n}
        for row in latency
    }


def timings_line(timings: Mapping[str, float]) -> str:
    """``start_spark 3.1s, read_broker 1.2s, ...``: the stages that ran, in order."""
    return ", ".join(f"{name} {timings[name]:.1f}s" for name in STAGES if name in timings)
