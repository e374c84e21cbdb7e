"""The reconciliation run: check inputs, read, classify, write (docs/architecture.md, section 7).

Inputs are checked before Spark starts, so a bad path or URL fails fast with a
``BadInput``. Each input is read once and cached, so every result of the run sees the
same snapshot of the outbox tables and broker files.

Stages (timed in ``Result.timings``): ``read_broker`` and ``read_outbox`` (read and
cache; the broker's records and the unreadable regions of its segments in one pass),
``classify`` (the categories, computed once and staged as Parquet partitioned by category,
then group stats and latency), ``write_outputs`` (category folders moved into place, the
unreadable regions, ``summary.json``, ``report.txt``, ``report.html``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession

from spark_reconcile import readers, report, transforms, unreadable
from spark_reconcile.errors import (
    BadInput,
    BrokerDataUnreadable,
    OutboxUnreadable,
    UnreadablePath,
)
from spark_reconcile.session import build_session, check_jars, default_jars

logger = logging.getLogger(__name__)

DEFAULT_GRACE = timedelta(minutes=5)
DEFAULT_ACK_THRESHOLD = timedelta(minutes=10)
JVM_LOG = "spark.log"
STAGES = ("read_outbox", "read_broker", "classify", "write_outputs")


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


def reconcile(
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
) -> dict[str, Any]:
    """Reconcile outbox tables (SQLAlchemy URLs) with broker data directories.

    Writes ``summary.json``, ``report.txt``, ``report.html``, one Parquet folder per
    non-empty category and one of unreadable regions (if any) under ``out``, and returns
    the summary. Raises ``BadInput`` for an unreadable path or a bad URL. Runs in
    ``spark`` when given (left running), else in a new session on ``master`` with the JDBC
    driver ``jars`` (default: Debian's) and extra Spark ``conf`` (stopped at the end).
    """
    return run(
        outboxes=outboxes,
        broker_dirs=broker_dirs,
        out=out,
        master=master,
        grace=grace,
        since=since,
        until=until,
        producers=producers,
        ack_threshold=ack_threshold,
        jars=jars,
        conf=conf,
        spark=spark,
    ).summary


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
) -> Result:
    """``reconcile`` with the details: stage timings, JDBC partitions and fetch size, and
    the reference time ``now`` (default: the start of the run), and ``jvm_log``: write a
    new session's JVM console output to ``spark.log`` under ``out``, not to stderr."""
    started = now or datetime.now(UTC)
    window = transforms.Window(now=started, grace=grace, since=since, until=until)
    sources, dirs, out_dir = _check_inputs(outboxes, broker_dirs, out, window)
    driver_jars = check_jars(default_jars() if jars is None else jars)
    info = report.RunInfo(
        started_at=started,
        outboxes=[s.label for s in sources],
        broker_dirs=dirs,
        since=since,
        until=until,
        settled_before=window.settled_before,
        grace_s=grace.total_seconds(),
        ack_threshold_s=ack_threshold.total_seconds(),
        producers=list(producers) if producers is not None else None,
    )
    owned = spark is None
    log = out_dir / JVM_LOG if jvm_log else None
    session = spark or build_session(master=master, jars=driver_jars, conf=conf, jvm_log=log)
    timings: dict[str, float] = {}
    cached: list[DataFrame] = []
    try:
        with _stage(timings, "read_broker"):
            read_messages = _cache(readers.read_broker(session, dirs, "messages"), cached)
            read_actions = _cache(readers.read_broker(session, dirs, "actions"), cached)
            _materialise_broker(read_messages, read_actions)
            messages = unreadable.records(read_messages)
            actions = unreadable.records(read_actions)
            regions = unreadable.regions(read_messages, read_actions)
        with _stage(timings, "read_outbox"):
            outbox = _cache(
                readers.read_outboxes(session, sources, partitions=partitions, fetchsize=fetchsize),
                cached,
            )
            _materialise_outbox(outbox, sources)
        with _stage(timings, "classify"):
            classified = transforms.classify(outbox, messages, window=window, producers=producers)
            report.prepare_out(out_dir)
            counts = report.stage_categories(classified, out_dir)
            acked = _cache(transforms.acked_messages(messages, actions), cached)
            groups = transforms.group_stats(
                messages,
                actions,
                now=started,
                ack_threshold=ack_threshold,
                window=window,
                acked=acked,
            ).collect()
            samples = transforms.latency_samples(messages, actions, window=window, acked=acked)
            samples = _cache(samples, cached)
            latency = transforms.latency_stats(samples).collect()
            histogram = _histogram(transforms.latency_histogram(samples).collect())
        with _stage(timings, "write_outputs"):
            damage = report.write_unreadable(regions, out_dir)
            doc = report.summary(
                counts, [r.asDict() for r in groups], [r.asDict() for r in latency], damage
            )
            text = report.render_text(doc, info)
            report.publish_categories(out_dir)
            report.write_reports(out_dir, doc, text, report.render_html(doc, info, histogram))
    finally:
        for frame in cached:
            frame.unpersist()
        if owned:
            session.stop()
    logger.info(
        "reconciliation finished",
        extra={"action": "reconcile.finished", "exit_code": doc["exit_code"], **timings},
    )
    return Result(summary=doc, text=text, timings=timings, out=out_dir)


def _check_inputs(
    outboxes: Sequence[str],
    broker_dirs: Sequence[str],
    out: str | Path,
    window: transforms.Window,
) -> tuple[list[readers.JdbcSource], list[str], Path]:
    if not outboxes:
        raise BadInput("give at least one outbox URL")
    if not broker_dirs:
        raise BadInput("give at least one broker data directory")
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


def _cache(frame: DataFrame, cached: list[DataFrame]) -> DataFrame:
    frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
    cached.append(frame)
    return frame


def _materialise_broker(messages: DataFrame, actions: DataFrame) -> None:
    try:
        messages.count()
        actions.count()
    except readers.SPARK_ERRORS as exc:
        raise BrokerDataUnreadable(f"broker data: {readers.first_line(exc)}") from exc


def _materialise_outbox(outbox: DataFrame, sources: Sequence[readers.JdbcSource]) -> None:
    try:
        outbox.count()
    except readers.SPARK_ERRORS as exc:
        labels = ", ".join(s.label for s in sources)
        raise OutboxUnreadable(f"outbox {labels}: {readers.first_line(exc)}") from exc


def _histogram(rows: Sequence[Any]) -> dict[str, dict[int, int]]:
    result: dict[str, dict[int, int]] = {}
    for row in rows:
        result.setdefault(str(row["metric"]), {})[int(row["bucket"])] = int(row["count"])
    return result


@contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    began = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = round(time.perf_counter() - began, 3)


def timings_line(timings: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {timings.get(name, 0.0):.1f}s" for name in STAGES)
