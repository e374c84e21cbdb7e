"""Reconciliation against NATS JetStream (``--jetstream URL --stream NAME``): the outbox's
rows sent through the SDK's JetStream transport, a lost message and an orphan planted.

The world: an outbox in a fresh PostgreSQL database whose service published ``SENT``
messages through ``Outbox(transport=JetStreamTransport(...))`` into a stream of its own on
the local NATS server, and one of them resent (JetStream's duplicate window drops it);
planted: a row marked ``sent`` whose message never reached the stream (``lost``), and a
message in the stream from the same producer with no outbox row (``orphan``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa
from pyspark.sql import SparkSession
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Outbox
from qmq_outbox.envelope import OutgoingMessage, ProduceResult, format_timestamp
from qmq_outbox.schema import metadata, outbox_table
from qmq_outbox.transports import JetStreamTransport
from qmq_outbox.transports import headers as envelope
from qmq_reconcile import CATEGORIES, reconcile
from qmq_reconcile.errors import StreamUnreadable
from qmq_reconcile.jetstream import CONNECT_TIMEOUT_S, StreamSource, fetch_rows
from tests.spark.worlds import row
from tests.support.postgres import fresh_database

pytestmark = pytest.mark.spark

NATS_URL = "nats://127.0.0.1:4222"
PRODUCER = "ledger-svc"
SENT = 20


@dataclass(frozen=True)
class World:
    outbox: str
    stream: str
    subject: str


async def _publish_orphan(stream_subject: str) -> None:
    """A message from PRODUCER that no outbox row stands for, as the transport writes one."""
    import nats

    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        await js.publish(
            stream_subject,
            b'{"orphan": true}',
            headers={
                "Nats-Msg-Id": "orphan",
                envelope.PRODUCER: PRODUCER,
                envelope.CREATED_AT: format_timestamp(datetime.now(UTC)),
            },
        )
    finally:
        await client.close()


async def _delete_stream(name: str) -> None:
    import nats

    client = await nats.connect(NATS_URL)
    try:
        await client.jetstream().delete_stream(name)
    finally:
        await client.close()


@pytest.fixture(scope="module")
def world(pg_admin_url: str) -> Iterator[World]:
    prefix = f"RECON{uuid.uuid4().hex[:8].upper()}"
    transport = JetStreamTransport(url=NATS_URL, stream_prefix=prefix)
    subject = f"{prefix.lower()}.ledger"
    stream = transport.stream_for(subject)
    with fresh_database(pg_admin_url, prefix="qmq_reconcile_js") as url:
        engine = sa.create_engine(url)
        metadata.create_all(engine, tables=[outbox_table])
        maker = sessionmaker(engine)
        outbox = Outbox(transport=transport, app=PRODUCER)
        outbox.install(maker)
        try:
            for n in range(SENT):
                with maker.begin() as session:
                    outbox.publish(session, subject, {"n": n}, key=f"acct-{n % 3}")
            assert outbox.close(drain_timeout=20)
            with Session(engine) as session:
                statuses = session.execute(sa.select(outbox_table.c.status)).scalars().all()
            assert statuses == ["sent"] * SENT
            # a resend of one of them, as a compensator would after a lost confirmation
            producer = transport.producer()
            try:
                (outcome,) = producer.produce([_first_message(engine)])
            finally:
                producer.close()
            assert isinstance(outcome, ProduceResult)
            assert outcome.status == "duplicate"
            old = datetime.now(UTC) - timedelta(hours=1)
            with engine.begin() as conn:  # sent, but it never reached the stream
                lost = row("lost", "sent", producer=PRODUCER, subject=subject, created=old)
                conn.execute(outbox_table.insert(), [lost])
            asyncio.run(_publish_orphan(subject))
            yield World(outbox=url, stream=stream, subject=subject)
        finally:
            engine.dispose()
            asyncio.run(_delete_stream(stream))


def _first_message(engine: sa.Engine) -> OutgoingMessage:
    """The first published row, as the compensator would send it again."""
    with engine.connect() as conn:
        first = conn.execute(sa.select(outbox_table).order_by(outbox_table.c.id)).first()
    assert first is not None
    return OutgoingMessage(
        id=first.message_id,
        subject=first.subject,
        body=bytes(first.body),
        key=first.key,
        headers=dict(first.headers or {}),
        producer=first.producer,
        created_at=first.created_at,
    )


def test_lost_and_orphan_are_found_in_a_jetstream_stream(
    world: World, tmp_path: Path, spark: SparkSession
) -> None:
    out = tmp_path / "out"
    summary = reconcile(
        outboxes=[world.outbox],
        broker_dirs=[],
        jetstream=NATS_URL,
        streams=[world.stream],
        out=out,
        grace=timedelta(0),
        spark=spark,
    )
    expected = {"delivered": SENT, "missing_in_broker": 1, "orphan_in_broker": 1}
    assert summary["categories"] == {c: expected.get(c, 0) for c in CATEGORIES}
    assert summary["exit_code"] == 1
    missing = spark.read.parquet(str(out / "missing_in_broker")).collect()
    assert [r["message_id"] for r in missing] == ["lost"]
    orphans = spark.read.parquet(str(out / "orphan_in_broker")).collect()
    assert [(r["message_id"], r["subject"]) for r in orphans] == [("orphan", world.subject)]
    delivered = spark.read.parquet(str(out / "delivered")).collect()
    assert {r["broker_copies"] for r in delivered} == {1}  # the resend was deduplicated
    assert summary["out_of_order"]["count"] == 0  # each key's messages stored in id order
    assert summary["groups"] == {}  # JetStream keeps no group state to read back
    assert summary["latency_ms"]["created_to_stored"]["count"] == SENT + 1
    text = (out / "report.txt").read_text()
    assert f"nats://127.0.0.1:4222/{world.stream}" in text


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "qmq_outbox", "reconcile", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_the_cli_reads_a_stream(world: World, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _cli(
        f"--outbox={world.outbox}",
        f"--jetstream={NATS_URL}",
        f"--stream={world.stream}",
        f"--out={out}",
        "--grace=0s",
        "--master=local[2]",
    )
    assert done.returncode == 1, done.stdout + done.stderr  # the planted critical findings
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["categories"]["missing_in_broker"] == 1
    assert summary["categories"]["orphan_in_broker"] == 1


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "give at least one broker data directory, JetStream stream or --consumed"),
        (["--stream=S"], 2, "--stream needs --jetstream"),
        ([f"--jetstream={NATS_URL}"], 2, "--jetstream needs at least one --stream"),
        (["--jetstream=http://127.0.0.1:4222", "--stream=S"], 2, "use nats://HOST:PORT"),
        ([f"--jetstream={NATS_URL}", "--stream=a.b"], 2, "a stream name is"),
        ([f"--jetstream={NATS_URL}", "--stream=QMQ_NO_SUCH_STREAM"], 3, "no such stream"),
        (["--jetstream=nats://127.0.0.1:1", "--stream=S"], 3, "cannot connect"),
        (["--consumed=sqlite:///x.db"], 2, "--consumed needs --group NAME and at least one"),
        (["--group=g", f"--jetstream={NATS_URL}", "--stream=S"], 2, "go with --consumed URL"),
        (["--consumed=sqlite:///x.db", "--group=a'b", "--subject=s"], 2, '--group "a\'b"'),
    ],
)
def test_bad_stream_options_are_one_line(
    args: list[str], code: int, message: str, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    created = datetime.now(UTC) - timedelta(hours=1)
    engine = sa.create_engine(db)
    metadata.create_all(engine, tables=[outbox_table])
    with engine.begin() as conn:
        conn.execute(
            outbox_table.insert(), [row("m", "sent", producer="p", subject="s", created=created)]
        )
    engine.dispose()
    done = _cli(f"--outbox={db}", f"--out={tmp_path / 'out'}", *args)
    assert done.returncode == code, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert message in lines[-1], done.stderr
    assert done.stdout == ""


def test_a_server_list_passes_over_a_refusing_server_and_a_refusal_fails_at_once(
    world: World,
) -> None:
    """Read before Spark starts: a refused server of a comma-separated list is passed over
    for the next; a list of refusing servers fails at once, naming the last refusal."""
    rows = fetch_rows([StreamSource(f"nats://127.0.0.1:1,{NATS_URL}", world.stream)])
    assert {"orphan"} <= {row["id"] for row in rows}
    began = time.monotonic()
    with pytest.raises(StreamUnreadable, match=r"cannot connect: .*Connect call failed"):
        fetch_rows([StreamSource("nats://127.0.0.1:1,nats://127.0.0.1:2", world.stream)])
    assert time.monotonic() - began < CONNECT_TIMEOUT_S  # no timeout waited out
    with pytest.raises(StreamUnreadable, match="no such stream"):
        fetch_rows([StreamSource(NATS_URL, f"{world.stream}_NONE")])
