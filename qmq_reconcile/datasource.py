"""The ``qmq-log`` PySpark data source: broker log segments as DataFrames.

    spark.dataSource.register(QmqLogDataSource)
    spark.read.format("qmq-log").option("kind", "messages").load("/var/lib/qmq")
    spark.read.format("qmq-log").option("kind", "actions")
        .option("paths", json.dumps([dir_a, dir_b])).load()

One input partition per segment file; each partition walks its segment with the broker's
own format module (``qmq_reconcile.scan`` over ``qmq_broker.format.walk_frames``) and yields
Arrow record batches. An unreadable region (a flipped byte, a torn write) costs the records
in it and no more: the walk resynchronises on the next valid frame. With the option
``unreadable=true`` each region that is damage (not the torn tail of a log's last segment)
also gives one row (``with_unreadable``). The executors must see the data directories at
the same paths as the driver (local mode, or a shared filesystem).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from qmq_broker.format import (
    ActionRecord,
    ActionType,
    BadRegion,
    SegmentKind,
    list_segments,
    segment_number,
)
from qmq_reconcile.scan import scan_actions, scan_messages
from qmq_wire.ordered import is_command, split_partition_log

FORMAT_NAME = "qmq-log"
DEFAULT_BATCH_ROWS = 8192
KINDS = {"messages": SegmentKind.MESSAGES, "actions": SegmentKind.ACTIONS}

# ``subject`` is the subject a record belongs to and ``partition`` its physical partition:
# physical partition p of an ordered subject S is stored as a log named ``S#p``
# (``qmq_wire.ordered.split_partition_log``); ``partition`` is null for a plain subject.
# ``command``: a command message (``qmq_wire.ordered.is_command``), which is not a message.
# ``tags``: the message's tags, null when it has none.
MESSAGE_SCHEMA = StructType(
    [
        StructField("broker", StringType(), False),
        StructField("segment", LongType(), False),
        StructField("offset", LongType(), False),
        StructField("id", StringType(), False),
        StructField("subject", StringType(), False),
        StructField("partition", LongType(), True),
        StructField("seq", LongType(), False),
        StructField("producer", StringType(), True),
        StructField("key", StringType(), True),
        StructField("command", BooleanType(), False),
        StructField("body_sha256", StringType(), False),
        StructField("created_at", TimestampType(), True),
        StructField("stored_at", TimestampType(), True),
        StructField("deliver_at", TimestampType(), True),
        StructField("tags", ArrayType(StringType(), False), True),
    ]
)

# One row per (action record, seq); a record without seqs (e.g. ``group``) gives one row
# with a null seq. ``start_seq`` is a ``group`` record's start cursor (its first seq), and
# ``tags`` the tag filter it fixes (``[]``: none, fixed after a reset; null: it fixes
# nothing, or a record of another type).
# ``subject`` and ``partition`` as in ``MESSAGE_SCHEMA``: a group's state on partition p
# of an ordered subject is kept per partition, and its seqs are that partition's.
ACTION_SCHEMA = StructType(
    [
        StructField("broker", StringType(), False),
        StructField("subject", StringType(), False),
        StructField("partition", LongType(), True),
        StructField("group", StringType(), False),
        StructField("state", StringType(), False),
        StructField("type", StringType(), False),
        StructField("seq", LongType(), True),
        StructField("at", TimestampType(), True),
        StructField("error", StringType(), True),
        StructField("start_seq", LongType(), True),
        StructField("tags", ArrayType(StringType(), False), True),
    ]
)

# With ``unreadable=true``: one more column, null on record rows; a row per unreadable
# region carries ``broker`` and this column only (every other column null).
UNREADABLE_FIELD = StructField(
    "unreadable",
    StructType(
        [
            StructField("segment", LongType(), False),
            StructField("offset", LongType(), False),
            StructField("length", LongType(), False),
        ]
    ),
    True,
)

START_SEQ_FIELDS = ("cursor", "start_seq")  # the broker writes "cursor"


def with_unreadable(schema: StructType) -> StructType:
    """``schema`` as read with ``unreadable=true``: every column nullable (a region row
    has no record), plus ``UNREADABLE_FIELD``."""
    fields = [StructField(f.name, f.dataType, True) for f in schema.fields]
    return StructType([*fields, UNREADABLE_FIELD])


def _region_row(broker: str, segment: int, region: BadRegion, width: int) -> tuple[Any, ...]:
    where = {"segment": segment, "offset": region.start, "length": region.end - region.start}
    return (broker, *([None] * (width - 1)), where)


def _us_or_none(value: int) -> int | None:
    return value if value > 0 else None


class _LogNames(dict[str, tuple[str, int | None]]):
    """``(subject, partition)`` of each stored log name, split once per name."""

    def __missing__(self, name: str) -> tuple[str, int | None]:
        split = self[name] = split_partition_log(name)
        return split


def _start_seq(record: ActionRecord) -> int | None:
    if record.type is not ActionType.GROUP:
        return None
    for name in START_SEQ_FIELDS:
        value = record.fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _tag_filter(record: ActionRecord) -> list[str] | None:
    """The tag filter a ``group`` record fixes (``qmq_broker.delivery``): ``[]`` for none
    (after a reset); None when it fixes nothing (absent, or another record type)."""
    tags = record.fields.get("tags") if record.type is ActionType.GROUP else None
    return [str(tag) for tag in tags] if isinstance(tags, list) else None


def _batches(
    rows: Iterator[tuple[Any, ...]], schema: pa.Schema, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    """Group rows into Arrow batches of ``batch_rows``."""
    pending: list[tuple[Any, ...]] = []
    for row in rows:
        pending.append(row)
        if len(pending) >= batch_rows:
            yield _to_batch(pending, schema)
            pending = []
    if pending:
        yield _to_batch(pending, schema)


def _to_batch(rows: list[tuple[Any, ...]], schema: pa.Schema) -> pa.RecordBatch:
    # Arrow turns the tuples into columns in C++, four times faster than zip(*rows).
    records = pa.array(rows, type=pa.struct(list(schema)))
    return pa.RecordBatch.from_struct_array(records)


def _message_rows(
    broker: str, path: Path, *, last_segment: bool, unreadable: bool
) -> Iterator[tuple[Any, ...]]:
    segment = segment_number(path)
    logs = _LogNames()
    sha256 = hashlib.sha256
    mark = (None,) if unreadable else ()
    for item in scan_messages(path, last_segment=last_segment):
        if isinstance(item, BadRegion):
            if unreadable:
                yield _region_row(broker, segment, item, len(MESSAGE_SCHEMA.fields))
            continue
        offset, fields = item
        seq, _, created, stored, deliver, log, id_, key, producer, headers, body, tags = fields
        subject, partition = logs[log]
        yield (
            broker,
            segment,
            offset,
            id_,
            subject,
            partition,
            seq,
            producer,
            key,
            is_command(headers),
            sha256(body).hexdigest(),
            created if created > 0 else None,
            stored if stored > 0 else None,
            deliver if deliver > 0 else None,
            list(tags) if tags else None,
            *mark,
        )


def message_batches(
    broker: str,
    path: Path,
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    last_segment: bool = True,
    unreadable: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Arrow batches (``MESSAGE_SCHEMA``) of every readable message record of one segment;
    with ``unreadable``, ``with_unreadable(MESSAGE_SCHEMA)`` and a row per damaged region.
    ``last_segment``: the segment is its log's last, whose torn tail is not damage."""
    rows = _message_rows(broker, path, last_segment=last_segment, unreadable=unreadable)
    schema = with_unreadable(MESSAGE_SCHEMA) if unreadable else MESSAGE_SCHEMA
    return _batches(rows, to_arrow_schema(schema, timezone="UTC"), batch_rows)


def _action_rows(
    broker: str,
    path: Path,
    *,
    types: frozenset[ActionType] | None,
    last_segment: bool,
    unreadable: bool,
) -> Iterator[tuple[Any, ...]]:
    logs = _LogNames()
    for item in scan_actions(path, last_segment=last_segment):
        if isinstance(item, BadRegion):
            if unreadable:
                width = len(ACTION_SCHEMA.fields)
                yield _region_row(broker, segment_number(path), item, width)
            continue
        rec: ActionRecord = item[1]
        if types is not None and rec.type not in types:
            continue
        error = rec.fields.get("error")
        subject, partition = logs[rec.subject]
        head = (broker, subject, partition, rec.group, rec.state, rec.type.name.lower())
        tail: tuple[Any, ...] = (
            _us_or_none(rec.at_us),
            None if error is None else str(error),
            _start_seq(rec),
            _tag_filter(rec),
        )
        if unreadable:
            tail = (*tail, None)
        for seq in rec.seqs or (None,):
            yield (*head, seq, *tail)


def action_batches(
    broker: str,
    path: Path,
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    types: frozenset[ActionType] | None = None,
    last_segment: bool = True,
    unreadable: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Arrow batches (``ACTION_SCHEMA``) of the action records (of ``types``, default all),
    one row per seq; ``last_segment`` and ``unreadable`` as for ``message_batches``."""
    rows = _action_rows(broker, path, types=types, last_segment=last_segment, unreadable=unreadable)
    schema = with_unreadable(ACTION_SCHEMA) if unreadable else ACTION_SCHEMA
    return _batches(rows, to_arrow_schema(schema, timezone="UTC"), batch_rows)


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


def segment_partitions(dirs: Sequence[str], kind: SegmentKind) -> list[tuple[str, str, bool]]:
    """``(broker label, segment path, last)`` for every segment of ``kind``, one per
    partition; ``last``: the newest segment of its log in that directory."""
    found = []
    for folder in dirs:
        segments = list_segments(folder, kind)
        found += [(folder, str(p), p == segments[-1]) for p in segments]
    return found


def schema_of(kind: str, *, unreadable: bool) -> StructType:
    """The rows' schema of a read of ``kind`` (messages|actions)."""
    records = MESSAGE_SCHEMA if kind == "messages" else ACTION_SCHEMA
    return with_unreadable(records) if unreadable else records


def read_table(
    dirs: Sequence[str],
    kind: str,
    *,
    types: frozenset[ActionType] | None = None,
    unreadable: bool = False,
) -> pa.Table:
    """The rows a ``qmq-log`` read of ``kind`` in ``dirs`` gives, read here in this process
    as one Arrow table (for data too small to be worth spreading over Python workers)."""
    reader = QmqLogReader(
        kind=kind,
        dirs=list(dirs),
        batch_rows=DEFAULT_BATCH_ROWS,
        types=types,
        unreadable=unreadable,
    )
    schema = to_arrow_schema(schema_of(kind, unreadable=unreadable), timezone="UTC")
    batches = [batch for part in reader.partitions() for batch in reader.read(part)]
    # An empty batch rather than none: PySpark cannot convert a table without chunks.
    return pa.Table.from_batches(
        batches or [pa.RecordBatch.from_pylist([], schema=schema)], schema=schema
    )


def flag(options: dict[str, str], name: str) -> bool:
    """A ``true``/``false`` option (default false)."""
    value = options.get(name, "false").strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"qmq-log option {name}={value!r}: use true or false")
    return value == "true"


class QmqLogDataSource(DataSource):
    """``spark.read.format("qmq-log")``: options ``kind`` (messages|actions), ``path`` or
    ``paths`` (JSON list of data directories; each row's ``broker`` column is its
    directory as given), ``types`` (actions only: comma-separated record types to read,
    e.g. ``group,ack,dead,redrive``; default all), ``unreadable`` (``true``: a row per
    damaged region, see ``with_unreadable``), ``batchRows`` (Arrow batch size)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def _options(self) -> dict[str, str]:
        return {str(k).lower(): str(v) for k, v in self.options.items()}

    def _kind(self) -> str:
        kind = self._options().get("kind", "messages").lower()
        if kind not in KINDS:
            raise ValueError(f"qmq-log option kind={kind!r}: use messages or actions")
        return kind

    def schema(self) -> StructType:
        return schema_of(self._kind(), unreadable=flag(self._options(), "unreadable"))

    def reader(self, schema: StructType) -> DataSourceReader:
        options = self._options()
        return QmqLogReader(
            kind=self._kind(),
            dirs=broker_dirs(options),
            batch_rows=int(options.get("batchrows", DEFAULT_BATCH_ROWS)),
            types=action_types(options.get("types")),
            unreadable=flag(options, "unreadable"),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QmqLogReader(DataSourceReader):
    """Plans one partition per segment; reads a segment into Arrow batches."""

    kind: str
    dirs: list[str]
    batch_rows: int
    types: frozenset[ActionType] | None = None
    unreadable: bool = False

    def partitions(self) -> Sequence[InputPartition]:
        found = segment_partitions(self.dirs, KINDS[self.kind])
        # Spark needs at least one partition; an empty one reads nothing.
        return [InputPartition(value) for value in found] or [InputPartition(None)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if partition.value is None:
            return iter(())
        broker, path, last = partition.value
        if self.kind == "messages":
            return message_batches(
                broker,
                Path(path),
                batch_rows=self.batch_rows,
                last_segment=last,
                unreadable=self.unreadable,
            )
        return action_batches(
            broker,
            Path(path),
            batch_rows=self.batch_rows,
            types=self.types,
            last_segment=last,
            unreadable=self.unreadable,
        )
