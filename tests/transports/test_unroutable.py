"""RabbitMQ, producer deployed before its consumers (issue 36 item 5): a message no queue is
bound for stays pending and is retried with backoff, a warning per subject per interval;
once a consumer declared its queue the next compensator pass sends it and the consumer gets
it once; past ``unroutable_dead_after`` the row goes dead saying why. Real RabbitMQ and
PostgreSQL.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from qmq_outbox.compensator import Compensator
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import outbox_table
from qmq_outbox.store import OutboxStore
from qmq_outbox.transports.base import ConsumerClient
from tests.support.outbox import pending_rows, wait_for
from tests.transports.kits import Kit, spec_of

pytestmark = pytest.mark.timeout(120)
BACKOFF = timedelta(milliseconds=100)


def rows(engine: Engine) -> dict[str, sa.Row[object]]:
    with engine.connect() as conn:
        return {r.message_id: r for r in conn.execute(sa.select(outbox_table))}


def unroutable_warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger
        and getattr(r, "action", "") == "outbox.unroutable"
        and r.levelno == logging.WARNING
    ]


def compensator(kit: Kit, engine: Engine, **settings: timedelta) -> Compensator:
    return Compensator(
        engine=engine,
        transport=kit.transport(),
        grace=timedelta(0),
        backoff_base=BACKOFF,
        backoff_cap=BACKOFF,
        outage_summary=timedelta(hours=1),
        **settings,
    )


def after_backoff(engine: Engine) -> None:
    latest = max(r.next_attempt_at.replace(tzinfo=UTC) for r in rows(engine).values())
    wait_for(lambda: datetime.now(UTC) > latest, what="the retry due")


def test_unroutable_stays_pending_until_a_consumer_binds_its_queue_then_goes_once(
    rabbitmq_kit: Kit, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="qmq_outbox")
    kit = rabbitmq_kit
    subject, group = kit.subject(), kit.group()
    outbox = Outbox(transport=kit.transport())
    maker = sessionmaker(engine)
    outbox.install(maker)
    with maker.begin() as session:
        ids = [outbox.publish(session, subject, {"i": i}) for i in range(3)]
    assert outbox.close(drain_timeout=15)
    assert {(r.status, r.attempts) for r in rows(engine).values()} == {("pending", 0)}
    assert len(unroutable_warnings(caplog, "qmq_outbox.dispatcher")) == 1

    comp = compensator(kit, engine)
    try:
        for _ in range(2):  # retried with backoff, never dead, one warning for the interval
            result = comp.run_once()
            assert (result.claimed, result.unroutable, result.retried, result.dead) == (3, 3, 3, 0)
            assert {r.status for r in rows(engine).values()} == {"pending"}
            after_backoff(engine)
        assert {r.attempts for r in rows(engine).values()} == {2}
        assert all("unroutable" in r.last_error for r in rows(engine).values())
        warnings = unroutable_warnings(caplog, "qmq_outbox.compensator")
        assert len(warnings) == 1
        assert f"3 message(s) of subject {subject} unroutable" in warnings[0]

        client: ConsumerClient = kit.run(kit.transport().open_consumer(spec_of(group, subject)))
        try:
            assert kit.run(client.pull(subject, group, "test", max_messages=10, wait_ms=0)) == []
            result = comp.run_once()  # the queue exists now
            assert (result.sent, result.unroutable, result.dead) == (3, 0, 0)
            got: Counter[str] = Counter()
            while sum(got.values()) < 3:
                batch = kit.run(client.pull(subject, group, "test", max_messages=10, wait_ms=5000))
                assert batch, f"only {got} arrived"
                got.update(m.id for m in batch)
                kit.run(client.ack(subject, group, "test", [m.seq for m in batch]))
            assert kit.run(client.pull(subject, group, "test", max_messages=10, wait_ms=1000)) == []
        finally:
            kit.run(client.aclose())
    finally:
        comp.stop(5)
    assert got == Counter(ids)
    assert {r.status for r in rows(engine).values()} == {"sent"}


def test_an_unroutable_row_goes_dead_past_the_configured_age_saying_why(
    rabbitmq_kit: Kit, engine: Engine
) -> None:
    kit = rabbitmq_kit
    subject = kit.subject()
    store = OutboxStore(engine)
    store.insert(pending_rows(2, subject=subject, age=120, prefix="old"))
    store.insert(pending_rows(1, subject=subject, age=5, prefix="young"))
    comp = compensator(kit, engine, unroutable_dead_after=timedelta(minutes=1))
    try:
        result = comp.run_once()
    finally:
        comp.stop(5)
    assert (result.claimed, result.unroutable, result.dead, result.retried) == (3, 3, 2, 1)
    found = rows(engine)
    assert {found[i].status for i in ("old-0", "old-1")} == {"dead"}
    assert found["young-0"].status == "pending"
    reason = found["old-0"].last_error
    assert reason.startswith("unroutable for longer than 0:01:00: rejected (unroutable)")
    assert f"no queue is bound for subject {subject}" in reason
