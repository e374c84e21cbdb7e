"""One flipped byte in a broker's message log is one unreadable region, not lost messages.

A real broker (``--segment-size`` 1 MiB) stores 300 messages of about 4 KiB, so its
message log spans two segments or more; a SQLite outbox has a ``sent`` row for each. A
copy of the data directory with one byte flipped inside a message frame in the middle of
the first segment is reconciled: the walk resynchronises after the damaged frame, so only
that message is missing, and the region is reported with its segment and offset. (Clean
directories report no region: ``test_reconcile_acceptance``.)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession

from qmq_broker.format import (
    MessageRecord,
    SegmentKind,
    iter_frames,
    list_segments,
    read_segment,
    segment_number,
)
from qmq_broker.format.frames import FRAME_SIZE
from qmq_outbox.client import BrokerClient
from qmq_reconcile import CATEGORIES, reconcile
from tests.spark.segments import flip_byte
from tests.spark.worlds import insert, produce, row
from tests.support.broker_process import BrokerProcess

pytestmark = pytest.mark.spark

SUBJECT, PRODUCER = "orders.created", "orders"
COUNT, PAD, BATCH = 300, 4000, 50
SEGMENT_SIZE = 1024 * 1024  # the broker's smallest


@dataclass(frozen=True)
class World:
    outbox: str
    broker_dir: Path
    names: list[str]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("damage")
    created = datetime.now(UTC) - timedelta(hours=1)
    names = [f"m{n:03d}" for n in range(COUNT)]
    outbox = f"sqlite:///{root / 'orders.db'}"
    placed: dict[str, Any] = {
        "producer": PRODUCER,
        "subject": SUBJECT,
        "created": created,
        "pad": PAD,
    }
    insert(outbox, [row(name, "sent", **placed) for name in names])
    broker = BrokerProcess(root / "broker", extra_args=["--segment-size", str(SEGMENT_SIZE)])
    try:
        broker.start()
        with BrokerClient(broker.url) as client:
            for start in range(0, COUNT, BATCH):
                produce(client, names[start : start + BATCH], **placed)
        assert broker.terminate() == 0
    finally:
        broker.stop()
    return World(outbox=outbox, broker_dir=broker.data_dir, names=names)


def copy_of(world: World, tmp_path: Path) -> Path:
    target = tmp_path / "broker"
    shutil.copytree(world.broker_dir, target)
    return target


def damage_middle_frame(broker_dir: Path) -> tuple[dict[str, Any], str]:
    """Flip a byte in the body of the middle message of the first message segment; the
    region the reconciliation should report and the id of the message it held."""
    segments = list_segments(broker_dir, SegmentKind.MESSAGES)
    assert len(segments) >= 2, "the world should span several message segments"
    first = segments[0]
    data, _ = read_segment(first)
    frames = list(iter_frames(data, path=str(first)))
    offset, payload = frames[len(frames) // 2]
    length = FRAME_SIZE + len(payload)
    flip_byte(first, offset + length - 10)  # inside the JSON body's padding
    region = {
        "broker": str(broker_dir),
        "log": "messages",
        "segment": segment_number(first),
        "offset": offset,
        "length": length,
    }
    return region, MessageRecord.decode(payload).id


def run(world: World, broker_dir: Path, out: Path, spark: SparkSession) -> dict[str, Any]:
    return reconcile(outboxes=[world.outbox], broker_dirs=[str(broker_dir)], out=out, spark=spark)


def test_one_flipped_byte_is_one_unreadable_region(
    world: World, tmp_path: Path, spark: SparkSession
) -> None:
    broker_dir = copy_of(world, tmp_path)
    region, lost = damage_middle_frame(broker_dir)
    out = tmp_path / "out"
    summary = run(world, broker_dir, out, spark)
    assert summary["unreadable_in_broker"] == {
        "count": 1,
        "bytes": region["length"],
        "regions": [region],
    }
    # Every other message in its category: only the one in the damaged frame is missing.
    assert summary["categories"] == {
        **{c: 0 for c in CATEGORIES},
        "delivered": COUNT - 1,
        "missing_in_broker": 1,
    }
    missing = spark.read.parquet(str(out / "missing_in_broker")).collect()
    assert [r["message_id"] for r in missing] == [lost]
    written = spark.read.parquet(str(out / "unreadable_in_broker")).collect()
    assert [r.asDict() for r in written] == [region]
    assert orjson.loads((out / "summary.json").read_bytes()) == summary
    text = (out / "report.txt").read_text()
    where = f"segment {region['segment']} offset {region['offset']} length {region['length']}"
    assert f"{broker_dir} messages {where}" in text
    assert "1 unreadable region(s) in broker data" in text
