"""Building reconciliation worlds: outbox rows in a database, messages in a real broker."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa

from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.schema import metadata, outbox_table


def body(name: str, version: int = 1, *, pad: int = 0) -> bytes:
    """A message's JSON body; ``pad`` adds that many bytes of filler."""
    doc: dict[str, Any] = {"id": name, "v": version}
    if pad:
        doc["pad"] = "x" * pad
    return orjson.dumps(doc)


def row(
    name: str, status: str, *, producer: str, subject: str, created: datetime, pad: int = 0
) -> dict[str, Any]:
    """An outbox row for message ``name`` with ``body(name, pad=pad)``."""
    return {
        "message_id": name,
        "subject": subject,
        "headers": {},
        "body": body(name, pad=pad),
        "content_type": "application/json",
        "producer": producer,
        "status": status,
        "next_attempt_at": created,
        "created_at": created,
        "sent_at": created + timedelta(milliseconds=20) if status == "sent" else None,
    }


def insert(url: str, rows: list[dict[str, Any]]) -> None:
    """Create the outbox table in the database at ``url`` (if missing) and add ``rows``."""
    engine = sa.create_engine(url)
    try:
        metadata.create_all(engine, tables=[outbox_table])
        with engine.begin() as conn:
            conn.execute(outbox_table.insert(), rows)
    finally:
        engine.dispose()


def produce(
    client: BrokerClient,
    names: list[str],
    *,
    subject: str,
    producer: str,
    created: datetime,
    version: int = 1,
    pad: int = 0,
) -> None:
    """Store one message per name in the broker (``body(name, version, pad=pad)``)."""
    messages = [
        OutgoingMessage(
            id=name,
            subject=subject,
            body=body(name, version, pad=pad),
            producer=producer,
            created_at=created,
        )
        for name in names
    ]
    results = client.produce(messages)
    assert {r.status for r in results} == {"stored"}


def drain(client: BrokerClient, subject: str, group: str, *, ack: bool) -> int:
    """Pull up to 100 messages for ``group`` (and ack them); how many were pulled."""
    pulled = client.pull(subject, group, f"{group}-1", max_messages=100)
    if ack:
        client.ack(subject, group, f"{group}-1", [m.seq for m in pulled])
    return len(pulled)
