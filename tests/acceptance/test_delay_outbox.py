"""SDK side: ``Outbox.publish(delay=...)`` through a real broker reaches a consumer on time."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox.client import BrokerClient
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import metadata
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import sqlite_transactions, statuses, wait_for


def test_a_delayed_publish_reaches_a_consumer_on_time_and_not_before(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    engine = sqlite_transactions(sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    metadata.create_all(engine)
    maker: sessionmaker[Session] = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url, app="orders")
    outbox.install(maker)
    try:
        with BrokerClient(broker.url) as client:
            with maker.begin() as session:
                published = datetime.now(UTC)
                late_id = outbox.publish(
                    session, "order.cancel", {"order_id": 7}, delay=timedelta(seconds=2)
                )
                at_id = outbox.publish(
                    session,
                    "order.cancel",
                    {"order_id": 8},
                    deliver_at=published + timedelta(seconds=1),
                )
            wait_for(lambda: statuses(engine).get(late_id) == "sent", what="row marked sent")
            assert client.subject("order.cancel")["scheduled"]["messages"] == 2
            arrivals: dict[str, float] = {}
            deadline = time.monotonic() + 10
            while len(arrivals) < 2 and time.monotonic() < deadline:
                for message in client.pull("order.cancel", "billing", "c", wait_ms=500):
                    arrivals[message.id] = time.time()
                    assert message.json()["order_id"] in (7, 8)
    finally:
        outbox.close()
        engine.dispose()
    assert list(arrivals) == [at_id, late_id]  # due order
    for message_id, delay in ((at_id, 1.0), (late_id, 2.0)):
        lateness = arrivals[message_id] - (published.timestamp() + delay)
        assert 0 <= lateness <= 0.6, f"{message_id} arrived {lateness:+.3f} s from its due time"
