"""The ``qmq-log`` PySpark data source: broker log segments as DataFrames.

    spark.dataSource.register(QmqLogDataSource)
    spark.read.format("qmq-log").option("kind", "messages").load("/var/lib/qmq")
    spark.read.format("qmq-log").option("kind", "actions")
        .option("paths", json.dumps([dir_a, dir_b])).load()

One input partition per segment file; each partition decodes its segment with the broker's
own format module (``broker.format``) and yields Arrow record batches. A torn tail (the
active segment of a running or killed broker) ends a segment's readable part: readers stop
at the last whole record, as the broker's recovery does. The executors must see the data
directories at the same paths as the driver (local mode, or a shared filesystem).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from broker.errors import CorruptRecord
from broker.format import (
    ActionRecord,
    ActionType,
    SegmentKind,
    iter_action_records,
    iter_frames,
    iter_message_records,
    list_segments,
    read_segment,
    segment_number,
)

FORMAT_NAME = "qmq-log"
DEFAULT_BATCH_ROWS = 8192
KINDS = {"messages": SegmentKind.MESSAGES, "actions": SegmentKind.ACTIONS}

MESSAGE_SCHEMA = StructType(
    [
        StructField("broker", StringType(), False),
        StructField("segment", LongType(), False),
        StructField("offset", LongType(), False),
        StructField("id", StringType(), False),
        StructField("subject", StringType(), False),
        StructField("seq", LongType(), False),
        StructField("producer", StringType(), True),
        StructField("key", StringType(), True),
        StructField("body_sha256", StringType(), False),
        StructField("created_at", TimestampType(), True),
        StructField("stored_at", TimestampType(), True),
        StructField("deliver_at", TimestampType(), True),
    ]
)

# One row per (action record, seq); a record without seqs (e.g. ``group``) gives one row
# with a null seq. ``start_seq`` is a ``group`` record's start cursor (its first seq).
ACTION_SCHEMA = StructType(
    [
        StructField("broker", StringType(), False),
        StructField("subject", StringType(), False),
        StructField("group", StringType(), False),
        StructField("state", StringType(), False),
        StructField("type", StringType(), False),
        StructField("seq", LongType(), True),
        StructField("at", TimestampType(), True),
        StructField("error", StringType(), True),
        StructField("start_seq", LongType(), True),
    ]
)

START_SEQ_FIELDS = ("cursor", "start_seq")  # the broker writes "cursor"


def _us_or_none(value: int) -> int | None:
    return value if value > 0 else None


def _start_seq(record: ActionRecord) -> int | None:
    if record.type is not ActionType.GROUP:
        return None
    for name in START_SEQ_FIELDS:
        value = record.fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _batches(
    rows: Iterator[tuple[Any, ...]], schema: pa.Schema, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    """Group rows into Arrow batches of ``batch_rows`` (columns built by transposing)."""
    pending: list[tuple[Any, ...]] = []
    for row in rows:
        pending.append(row)
        if len(pending) >= batch_rows:
            yield _to_batch(pending, schema)
            pending = []
    if pending:
        yield _to_batch(pending, schema)


def _to_batch(rows: list[tuple[Any, ...]], schema: pa.Schema) -> pa.RecordBatch:
    columns = zip(*rows, strict=True)
    arrays = [
        pa.array(values, type=field.type) for field, values in zip(schema, columns, strict=True)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def message_batches(
    broker: str, path: Path, *, batch_rows: int = DEFAULT_BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """Arrow batches (``MESSAGE_SCHEMA``) of every whole message record of one segment."""
    segment = segment_number(path)
    rows = (
        (
            broker,
            segment,
            offset,
            rec.id,
            rec.subject,
            rec.seq,
            rec.producer,
            rec.key,
            hashlib.sha256(rec.body).hexdigest(),
            _us_or_none(rec.created_at_us),
            _us_or_none(rec.stored_at_us),
            _us_or_none(rec.deliver_at_us),
        )
        for offset, rec in iter_message_records(path)
    )
    return _batches(rows, to_arrow_schema(MESSAGE_SCHEMA, timezone="UTC"), batch_rows)


def _action_records(path: Path, types: frozenset[ActionType] | None) -> Iterator[ActionRecord]:
    """Whole action records of a segment; with ``types``, others are skipped undecoded (by
    their type byte), which spares decoding the bulky lease records nobody reads."""
    if types is None:
        for _, rec in iter_action_records(path):
            yield rec
        return
    data, kind = read_segment(path)
    if kind is not SegmentKind.ACTIONS:
        raise CorruptRecord(path=str(path), offset=0, reason=f"a {kind.name} segment")
    wanted = bytes(int(t) for t in types)
    for offset, payload in iter_frames(data, path=str(path)):
        if payload[:1] in wanted:
            yield ActionRecord.decode(payload, path=str(path), offset=offset)


def _action_rows(
    broker: str, path: Path, types: frozenset[ActionType] | None
) -> Iterator[tuple[Any, ...]]:
    for rec in _action_records(path, types):
        error = rec.fields.get("error")
        head = (broker, rec.subject, rec.group, rec.state, rec.type.name.lower())
        tail = (_us_or_none(rec.at_us), None if error is None else str(error), _start_seq(rec))
        for seq in rec.seqs or (None,):
            yield (*head, seq, *tail)


def action_batches(
    broker: str,
    path: Path,
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    types: frozenset[ActionType] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Arrow batches (``ACTION_SCHEMA``) of the action records (of ``types``, default all),
    one row per seq."""
    rows = _action_rows(broker, path, types)
    return _batches(rows, to_arrow_schema(ACTION_SCHEMA, timezone="UTC"), batch_rows)


def action_types(option: str | None) -> frozenset[ActionType] | None:
    """``"ack,dead"`` -> those types; ``None`` or empty -> every type."""
    if not option:
        return None
    try:
        return frozenset(ActionType[name.strip().upper()] for name in option.split(","))
    except KeyError as exc:
        known = ", ".join(t.name.lower() for t in ActionType)
        raise ValueError(f"qmq-log option types: unknown type {exc} (use {known})") from None


def broker_dirs(options: dict[str, str]) -> list[str]:
    """The data directories named by the ``path`` or ``paths`` (JSON list) options."""
    dirs: list[str] = []
    if options.get("paths"):
        parsed = json.loads(options["paths"])
        if not isinstance(parsed, list) or not all(isinstance(p, str) for p in parsed):
            raise ValueError("option 'paths' must be a JSON list of directories")
        dirs.extend(parsed)
    if options.get("path"):
        dirs.append(options["path"])
    if not dirs:
        raise ValueError("qmq-log needs a data directory: load(dir) or option('paths', [...])")
    return dirs


def segment_partitions(dirs: Sequence[str], kind: SegmentKind) -> list[tuple[str, str]]:
    """``(broker label, segment path)`` for every segment of ``kind``, one per partition."""
    return [(d, str(p)) for d in dirs for p in list_segments(d, kind)]


class QmqLogDataSource(DataSource):
    """``spark.read.format("qmq-log")``: options ``kind`` (messages|actions), ``path`` or
    ``paths`` (JSON list of data directories; each row's ``broker`` column is its
    directory as given), ``types`` (actions only: comma-separated record types to read,
    e.g. ``group,ack,dead,redrive``; default all), ``batchRows`` (Arrow batch size)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def _kind(self) -> str:
        kind = str(self.options.get("kind", "messages")).lower()
        if kind not in KINDS:
            raise ValueError(f"qmq-log option kind={kind!r}: use messages or actions")
        return kind

    def schema(self) -> StructType:
        return MESSAGE_SCHEMA if self._kind() == "messages" else ACTION_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        options = {str(k).lower(): str(v) for k, v in self.options.items()}
        batch_rows = int(options.get("batchrows", DEFAULT_BATCH_ROWS))
        return QmqLogReader(
            kind=self._kind(),
            dirs=broker_dirs(options),
            batch_rows=batch_rows,
            types=action_types(options.get("types")),
        )


class QmqLogReader(DataSourceReader):
    """Plans one partition per segment; reads a segment into Arrow batches."""

    def __init__(
        self,
        *,
        kind: str,
        dirs: list[str],
        batch_rows: int,
        types: frozenset[ActionType] | None = None,
    ) -> None:
        self.kind = kind
        self.dirs = dirs
        self.batch_rows = batch_rows
        self.types = types

    def partitions(self) -> Sequence[InputPartition]:
        found = segment_partitions(self.dirs, KINDS[self.kind])
        # Spark needs at least one partition; an empty one reads nothing.
        return [InputPartition(value) for value in found] or [InputPartition(None)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if partition.value is None:
            return iter(())
        broker, path = partition.value
        if self.kind == "messages":
            return message_batches(broker, Path(path), batch_rows=self.batch_rows)
        return action_batches(broker, Path(path), batch_rows=self.batch_rows, types=self.types)
