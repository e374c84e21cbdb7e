"""Reading the inputs: outbox tables over JDBC and broker data directories via ``qmq-log``.

Every failure to read is translated here, once, into a ``BadInput`` subclass.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import orjson
import pyarrow as pa
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.readwriter import DataFrameReader
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from qmq_broker.errors import CorruptRecord
from qmq_broker.format import HEADER_SIZE, SEGMENT_LAYOUT_FORMATS, SegmentKind, list_segments
from qmq_broker.format import read_segment_header as check_header
from qmq_reconcile.datasource import (
    FORMAT_NAME,
    KINDS,
    QmqLogDataSource,
    action_types,
    read_table,
    schema_of,
)
from qmq_reconcile.errors import (
    BadInput,
    BadOutboxUrl,
    BrokerDataUnreadable,
    ConsumedUnreadable,
    OutboxUnreadable,
    UnreadablePath,
)
from qmq_reconcile.session import is_local

DEFAULT_TABLE = "qmq_outbox"
DEFAULT_FETCHSIZE = 10_000
OUTBOX_COLUMNS = (
    "outbox",
    "row_id",
    "message_id",
    "subject",
    "producer",
    "status",
    "body_sha256",
    "created_at",
    "sent_at",
    "deliver_at",
)

try:  # py4j is how JVM-side failures reach Python
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    SPARK_ERRORS: tuple[type[Exception], ...] = (PySparkException, Py4JError)
except ImportError:  # pragma: no cover
    SPARK_ERRORS = (PySparkException,)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class JdbcSource:
    """An outbox database as Spark's JDBC reader sees it."""

    label: str  # the SQLAlchemy URL without its password
    jdbc_url: str
    driver: str
    dialect: str  # "postgresql" | "sqlite"
    properties: dict[str, str] = dataclasses.field(default_factory=dict)


def jdbc_source(url: str) -> JdbcSource:
    """Turn the service's SQLAlchemy URL into a JDBC URL (PostgreSQL or SQLite)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise BadOutboxUrl(f"outbox URL {url!r} is not a database URL: {exc}") from exc
    backend = parsed.get_backend_name()
    label = parsed.render_as_string(hide_password=True)
    if backend == "postgresql":
        return _postgres(parsed, label)
    if backend == "sqlite":
        return _sqlite(parsed, label)
    raise BadOutboxUrl(f"outbox URL {label}: {backend} is not supported (PostgreSQL or SQLite)")


def _postgres(url: URL, label: str) -> JdbcSource:
    if not url.database:
        raise BadOutboxUrl(f"outbox URL {label} names no database")
    host = url.host or "localhost"
    netloc = f"[{host}]" if ":" in host else host
    if url.port:
        netloc += f":{url.port}"
    query = "&".join(
        f"{quote(k)}={quote(v)}"
        for k, values in url.query.items()
        for v in ((values,) if isinstance(values, str) else values)
    )
    jdbc = f"jdbc:postgresql://{netloc}/{quote(url.database)}" + (f"?{query}" if query else "")
    props = {"user": url.username or "", "password": url.password or ""}
    props = {k: str(v) for k, v in props.items() if v}
    return JdbcSource(
        label=label, jdbc_url=jdbc, driver="org.postgresql.Driver", dialect="postgresql",
        properties=props,
    )  # fmt: skip


def _sqlite(url: URL, label: str) -> JdbcSource:
    if not url.database or url.database == ":memory:" or url.database.startswith("file:"):
        raise BadOutboxUrl(f"outbox URL {label}: give a SQLite database file (sqlite:///path)")
    path = Path(url.database)
    if not path.is_file():
        raise UnreadablePath(f"outbox database {path} does not exist")
    try:
        with path.open("rb") as handle:
            header = handle.read(16)
    except OSError as exc:
        raise UnreadablePath(f"outbox database {path} cannot be read: {exc}") from exc
    if header and header != b"SQLite format 3\x00":
        raise UnreadablePath(f"outbox database {path} is not a SQLite database")
    return JdbcSource(
        label=label,
        jdbc_url=f"jdbc:sqlite:{path.resolve()}",
        driver="org.sqlite.JDBC",
        dialect="sqlite",
    )


def _reader(spark: SparkSession, source: JdbcSource, fetchsize: int) -> DataFrameReader:
    reader = (
        spark.read.format("jdbc")
        .option("url", source.jdbc_url)
        .option("driver", source.driver)
        .option("fetchsize", str(fetchsize))
    )
    for key, value in source.properties.items():
        reader = reader.option(key, value)
    return reader


_SELECT = "id, message_id, subject, producer, status, body, created_at, sent_at, deliver_at"
# SQLite keeps SQLAlchemy's DateTime as text, which the xerial driver will not hand to Spark
# as a timestamp: read those columns as strings and cast them in Spark (UTC).
_SQLITE_SCHEMA = (
    "id LONG, message_id STRING, subject STRING, producer STRING, status STRING, "
    "body BINARY, created_at STRING, sent_at STRING, deliver_at STRING"
)


def _bounds(
    spark: SparkSession, source: JdbcSource, table: str, fetchsize: int
) -> tuple[int, int, int]:
    query = (
        "(SELECT COALESCE(MIN(id), 0) AS lo, COALESCE(MAX(id), 0) AS hi, COUNT(*) AS n"
        f" FROM {table}) bounds"
    )
    reader = _reader(spark, source, fetchsize).option("dbtable", query)
    if source.dialect == "sqlite":
        reader = reader.option("customSchema", "lo LONG, hi LONG, n LONG")
    row = reader.load().collect()[0]
    lo, hi, n = row["lo"], row["hi"], row["n"]
    return (int(lo or 0), int(hi or 0), int(n or 0))


def read_outbox(
    spark: SparkSession,
    source: JdbcSource,
    *,
    table: str = DEFAULT_TABLE,
    partitions: int | None = None,
    fetchsize: int = DEFAULT_FETCHSIZE,
) -> DataFrame:
    """An outbox table, read with ``partitions`` parallel range reads over ``id``.

    Columns: ``OUTBOX_COLUMNS``; the body is reduced to its SHA-256 (hex) as the broker's
    bodies are, so bodies never leave the executors that read them.
    """
    parallel = partitions or spark.sparkContext.defaultParallelism
    try:
        # One read needs no bounds (a query, and a Spark job, fewer).
        lo, hi, count = _bounds(spark, source, table, fetchsize) if parallel > 1 else (0, 0, 0)
        reader = _reader(spark, source, fetchsize).option(
            "dbtable", f"(SELECT {_SELECT} FROM {table}) outbox"
        )
        if source.dialect == "sqlite":
            reader = reader.option("customSchema", _SQLITE_SCHEMA)
        if count > 1 and parallel > 1 and hi > lo:
            reader = (
                reader.option("partitionColumn", "id")
                .option("lowerBound", str(lo))
                .option("upperBound", str(hi + 1))
                .option("numPartitions", str(min(parallel, count)))
            )
        frame = reader.load()
    except SPARK_ERRORS as exc:
        raise OutboxUnreadable(f"outbox {source.label}: {first_line(exc)}") from exc
    return _normalise(frame, source)


def _timestamp(name: str, dialect: str) -> Column:
    column = F.col(name)
    return column.cast("timestamp") if dialect == "sqlite" else column


def _normalise(frame: DataFrame, source: JdbcSource) -> DataFrame:
    return frame.select(
        F.lit(source.label).alias("outbox"),
        F.col("id").cast("long").alias("row_id"),
        F.col("message_id"),
        F.col("subject"),
        F.col("producer"),
        F.col("status"),
        F.sha2(F.col("body").cast("binary"), 256).alias("body_sha256"),
        _timestamp("created_at", source.dialect).alias("created_at"),
        _timestamp("sent_at", source.dialect).alias("sent_at"),
        _timestamp("deliver_at", source.dialect).alias("deliver_at"),
    )


def read_outboxes(
    spark: SparkSession,
    sources: Sequence[JdbcSource],
    *,
    partitions: int | None = None,
    fetchsize: int = DEFAULT_FETCHSIZE,
    table: str = DEFAULT_TABLE,
) -> DataFrame:
    """The union of several outbox tables (the ``outbox`` column says which)."""
    frames = [
        read_outbox(spark, s, table=table, partitions=partitions, fetchsize=fetchsize)
        for s in sources
    ]
    result = frames[0]
    for frame in frames[1:]:
        result = result.unionByName(frame)
    return result


CONSUMED_TABLE = "qmq_consumed"
GROUP_NAME = re.compile(r"^[A-Za-z0-9._@\-]{1,200}$")


def read_consumed(
    spark: SparkSession, source: JdbcSource, *, group: str, fetchsize: int = DEFAULT_FETCHSIZE
) -> DataFrame:
    """``message_id, consumed_at`` of ``group``'s handled messages (its ``done`` rows) in a
    consumer database's ``qmq_consumed`` table (``IdempotentStore``'s)."""
    if not GROUP_NAME.match(group):  # it goes into the query's text
        raise BadInput(f"--group {group!r}: 1-200 of A-Z a-z 0-9 . _ - @")
    query = (
        f"(SELECT message_id, consumed_at FROM {CONSUMED_TABLE}"
        f" WHERE consumer_group = '{group}' AND status = 'done') consumed"
    )
    reader = _reader(spark, source, fetchsize).option("dbtable", query)
    if source.dialect == "sqlite":
        reader = reader.option("customSchema", "message_id STRING, consumed_at STRING")
    try:
        frame = reader.load()
    except SPARK_ERRORS as exc:
        raise ConsumedUnreadable(f"consumer database {source.label}: {first_line(exc)}") from exc
    return frame.select(
        F.col("message_id"), _timestamp("consumed_at", source.dialect).alias("consumed_at")
    )


def check_broker_dir(path: str) -> str:
    """Raise ``BadInput`` unless ``path`` is a readable broker data directory."""
    folder = Path(path)
    if not folder.exists():
        raise UnreadablePath(f"broker data directory {path} does not exist")
    if not folder.is_dir():
        raise UnreadablePath(f"broker data directory {path} is not a directory")
    marker = folder / "FORMAT"
    if not marker.exists() and not (folder / "messages").is_dir():
        raise UnreadablePath(f"{path} is not a broker data directory (no FORMAT, no messages/)")
    if marker.exists():
        try:
            version = orjson.loads(marker.read_bytes()).get("format")
        except (OSError, orjson.JSONDecodeError, AttributeError) as exc:
            raise BrokerDataUnreadable(f"{marker} cannot be read: {exc}") from exc
        if version not in SEGMENT_LAYOUT_FORMATS:
            readable = " or ".join(map(str, SEGMENT_LAYOUT_FORMATS))
            raise BrokerDataUnreadable(f"{path} has data format {version}, not {readable}")
    for kind in (SegmentKind.MESSAGES, SegmentKind.ACTIONS):
        for segment in list_segments(folder, kind):
            try:
                with segment.open("rb") as handle:
                    found = check_header(handle.read(HEADER_SIZE), path=str(segment))
            except OSError as exc:
                raise UnreadablePath(f"segment {segment} cannot be read: {exc}") from exc
            except CorruptRecord as exc:
                raise BrokerDataUnreadable(str(exc)) from exc
            if found is not kind:
                raise BrokerDataUnreadable(f"segment {segment} is a {found.name} segment")
    return path


# The action records the transforms use; leases and retries give no rows.
ACTION_TYPES = "group,ack,dead,redrive"
# Segments up to this size in all are read in the driver: planning a Python data source read
# and starting its workers costs seconds; decoding this much costs about one.
IN_DRIVER_MAX_BYTES = 8 * 2**20
# On a local master the driver shares the executors' machine: decoding there, while the JVM
# reads the outbox, spares the Python workers' start and their Arrow transfers (a sixth of
# a million-message run's CPU). One process decodes about 40 MB a second, so past this
# size the workers' decoding side by side wins.
LOCAL_IN_DRIVER_MAX_BYTES = 256 * 2**20


def reads_in_driver(dirs: Sequence[str], kind: str, *, local: bool) -> bool:
    """Whether ``read_broker`` decodes the ``kind`` segments of ``dirs`` in this process
    (``local``: on a local master)."""
    limit = LOCAL_IN_DRIVER_MAX_BYTES if local else IN_DRIVER_MAX_BYTES
    return segment_bytes(dirs, kind) <= limit


def decode_broker(dirs: Sequence[str], kind: str) -> pa.Table:
    """The rows ``read_broker`` gives, decoded in this process into one Arrow table."""
    types = ACTION_TYPES if kind == "actions" else ""
    try:
        return read_table(dirs, kind, types=action_types(types), unreadable=True)
    except OSError as exc:
        raise UnreadablePath(f"broker data: {exc}") from exc
    except CorruptRecord as exc:
        raise BrokerDataUnreadable(str(exc)) from exc


def read_broker(spark: SparkSession, dirs: Sequence[str], kind: str) -> DataFrame:
    """Message or action records of the data directories, with a row per unreadable region
    (``unreadable=true``; ``unreadable.records`` and ``unreadable.regions`` part them).

    Read by the ``qmq-log`` data source, one partition per segment, or, when the segments
    are small (``reads_in_driver``), by the same code in this process.
    """
    if reads_in_driver(dirs, kind, local=is_local(spark.sparkContext.master)):
        decoded = decode_broker(dirs, kind)
        frame = spark.createDataFrame(decoded, schema=schema_of(kind, unreadable=True))
        # One partition per Arrow batch: a few per core are enough.
        return frame.coalesce(spark.sparkContext.defaultParallelism)
    # Registered here, not with the session: the first registration costs seconds.
    spark.dataSource.register(QmqLogDataSource)
    reader = spark.read.format(FORMAT_NAME).option("kind", kind).option("unreadable", "true")
    if kind == "actions":
        reader = reader.option("types", ACTION_TYPES)
    return reader.option("paths", json.dumps(list(dirs))).load()


def segment_bytes(dirs: Sequence[str], kind: str) -> int:
    """The size of the segments of ``kind`` in ``dirs``."""
    total = 0
    for folder in dirs:
        for segment in list_segments(folder, KINDS[kind]):
            try:
                total += segment.stat().st_size
            except OSError as exc:
                raise UnreadablePath(f"segment {segment} cannot be read: {exc}") from exc
    return total


def first_line(exc: BaseException) -> str:
    """One line saying what went wrong in Spark or the JVM (the root cause's message)."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            root = java
            while root.getCause() is not None:
                root = root.getCause()
            return str(root.toString()).splitlines()[0]
        except Exception:  # the gateway may be gone; fall back to the Python text
            pass
    for line in str(exc).strip().splitlines():
        line = line.strip()
        if line and not line.startswith(("An error occurred", "JVM stacktrace", "at ")):
            return line
    return type(exc).__name__
