"""NATS JetStream streams as broker data: every message a stream holds, read back by its
stream sequence, as the rows a broker data directory gives (``datasource.MESSAGE_SCHEMA``).

A stream is read with JetStream's message-get API, sequence by sequence from the stream's
first to its last (``WINDOW`` requests in flight): nothing is consumed, no consumer is made,
and a sequence deleted meanwhile is skipped. What the SDK's JetStream transport writes
(docs/transports.md) maps onto the columns: the id is the ``Nats-Msg-Id`` header (the
outbox's message id), producer, key and creation time are its ``qmq-`` headers, ``stored_at``
is the time the stream stored the message, ``seq`` its stream sequence. A message without a
``Nats-Msg-Id`` (written by someone else) gets the id ``<stream>#<seq>``: it can only be an
orphan or belong to a producer that is not reconciled. JetStream records no group state the
reconciliation could read back as actions, so a stream adds messages only: no group counts,
no stored-to-acked latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema

from qmq_outbox.envelope import parse_timestamp
from qmq_outbox.transports import headers as envelope
from qmq_reconcile.datasource import schema_of
from qmq_reconcile.errors import BadInput, StreamUnreadable

MSG_ID = "Nats-Msg-Id"
WINDOW = 256  # message-get requests in flight per stream
CONNECT_TIMEOUT_S = 5
REQUEST_TIMEOUT_S = 10.0
STREAM_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


@dataclasses.dataclass(frozen=True, slots=True)
class StreamSource:
    """One stream of one NATS server (or cluster: comma-separated URLs)."""

    url: str
    stream: str

    @property
    def label(self) -> str:
        """How the reports name it: the server's address (no credentials) and the stream."""
        hosts = ",".join(
            f"nats://{urlsplit(one.strip()).hostname}:{urlsplit(one.strip()).port or 4222}"
            for one in self.url.split(",")
        )
        return f"{hosts}/{self.stream}"


def stream_sources(url: str | None, streams: Sequence[str]) -> list[StreamSource]:
    """The streams to read: ``streams`` of the server at ``url``; ``BadInput`` when only one
    of them is given, for a URL that is not ``nats://`` or a name NATS does not allow."""
    if url is None and not streams:
        return []
    if url is None:
        raise BadInput("--stream needs --jetstream nats://HOST:PORT")
    if not streams:
        raise BadInput("--jetstream needs at least one --stream NAME")
    for one in url.split(","):
        parts = urlsplit(one.strip())
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise BadInput(f"--jetstream {url!r}: use nats://HOST:PORT")
        try:
            parts.port  # noqa: B018 - a bad port raises here
        except ValueError as exc:
            raise BadInput(f"--jetstream {url!r}: {exc}") from exc
    for name in streams:
        if not name or not set(name) <= STREAM_NAME_CHARS:
            raise BadInput(f"--stream {name!r}: a stream name is A-Z a-z 0-9 _ -")
    return [StreamSource(url, name) for name in dict.fromkeys(streams)]


StreamRows = list[dict[str, Any]]  # the streams' messages, column name -> value


def read_streams(spark: SparkSession, rows: StreamRows) -> DataFrame:
    """The streams' messages (``fetch_rows``) as a ``qmq-log`` messages read with
    ``unreadable=true`` gives them (a stream has no unreadable regions: that column is null)."""
    schema = schema_of("messages", unreadable=True)
    table = pa.Table.from_pylist(rows, schema=to_arrow_schema(schema, timezone="UTC"))
    return spark.createDataFrame(table, schema=schema)


def fetch_rows(sources: Sequence[StreamSource]) -> StreamRows:
    """Every stream's messages as rows, stream by stream; ``StreamUnreadable`` when a server
    does not answer or does not hold a stream. The job reads them before Spark starts."""
    return asyncio.run(_fetch_all(sources))


async def _fetch_all(sources: Sequence[StreamSource]) -> StreamRows:
    rows: StreamRows = []
    for source in sources:
        rows.extend(await _fetch(source))
    return rows


async def _fetch(source: StreamSource) -> StreamRows:
    import nats.errors
    import nats.js.errors
    from nats.aio.client import Client

    failures: list[Exception] = []

    async def note(exc: Exception) -> None:
        """nats-py reports each failed attempt here: the last one says why."""
        failures.append(exc)

    client = Client()
    try:
        await asyncio.wait_for(  # a server that accepts and never answers: bounded here
            client.connect(
                servers=[one.strip() for one in source.url.split(",")],
                connect_timeout=CONNECT_TIMEOUT_S,
                allow_reconnect=False,
                max_reconnect_attempts=1,  # each server once: a refusal fails at once
                reconnect_time_wait=0,
                error_cb=note,
            ),
            CONNECT_TIMEOUT_S,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        with contextlib.suppress(Exception):
            await client.close()
        reason = str(failures[-1] if failures else exc) or (
            f"no connection within {CONNECT_TIMEOUT_S:g} s"
        )
        raise StreamUnreadable(f"JetStream {source.label}: cannot connect: {reason}") from exc
    try:
        js = client.jetstream(timeout=REQUEST_TIMEOUT_S)
        try:
            info = await js.stream_info(source.stream)
        except nats.js.errors.NotFoundError as exc:
            raise StreamUnreadable(f"JetStream {source.label}: no such stream") from exc
        first, last = info.state.first_seq, info.state.last_seq
        rows: StreamRows = []
        for start in range(first, last + 1, WINDOW):
            seqs = range(start, min(start + WINDOW, last + 1))
            found = await asyncio.gather(*(_get(js, source.stream, seq) for seq in seqs))
            rows.extend(_row(source, msg) for msg in found if msg is not None)
        return rows
    except (OSError, nats.errors.Error) as exc:
        raise StreamUnreadable(f"JetStream {source.label}: {exc}") from exc
    finally:
        await client.close()


async def _get(js: Any, stream: str, seq: int) -> Any:
    import nats.js.errors

    try:
        return await js.get_msg(stream, seq)
    except nats.js.errors.NotFoundError:  # deleted, or removed by the stream's limits
        return None


def _row(source: StreamSource, msg: Any) -> dict[str, Any]:
    fields: dict[str, str] = dict(msg.headers or {})
    data: bytes = msg.data or b""
    return {
        "broker": source.label,
        "segment": 0,
        "offset": msg.seq,
        "id": fields.get(MSG_ID) or f"{source.stream}#{msg.seq}",
        "subject": msg.subject,
        "partition": None,
        "seq": msg.seq,
        "producer": fields.get(envelope.PRODUCER),
        "key": fields.get(envelope.KEY),
        "command": False,
        "body_sha256": hashlib.sha256(data).hexdigest(),
        "created_at": _created(fields.get(envelope.CREATED_AT)),
        "stored_at": msg.time,
        "deliver_at": None,
        "tags": envelope.decode(fields).tags or None,
        "unreadable": None,
    }


def _created(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return parse_timestamp(text)
    except ValueError:  # written by someone else: no creation time to judge by
        return None
