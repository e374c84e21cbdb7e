"""The compensator cannot be forgotten (issue 36 item 6), with real broker processes and
PostgreSQL: ``Outbox.run_compensator`` sends what a killed process left; the dispatcher
sends what it held once the broker is back, well inside the compensator's grace; ``qmq
compensator --once`` names the rows still in their grace and when the next falls due.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import sessionmaker

from qmq_outbox.client import BrokerClient
from qmq_outbox.compensator.config import CompensatorSettings
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.outbox import Outbox
from qmq_outbox.store import OutboxStore
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import (
    pending_rows,
    statuses,
    stored_ids,
    unique_subject,
    wait_for,
    wait_for_async,
)

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
FAST: CompensatorSettings = {"grace": timedelta(seconds=1), "interval": timedelta(milliseconds=100)}


@pytest.fixture
def db_url(pg_url_migrated: str) -> str:
    return pg_url_migrated  # PostgreSQL alone here


@pytest.fixture(scope="module")
def broker(module_broker: BrokerProcess) -> BrokerProcess:
    return module_broker


def compensator_threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_the_in_process_compensator_sends_what_a_killed_process_committed(
    engine: sa.Engine, pg_url_migrated: str, broker: BrokerProcess
) -> None:
    subject = unique_subject("killed")
    killed_args = [pg_url_migrated, broker.url, subject, "25"]
    killed = subprocess.run(
        [sys.executable, "-m", "tests.support.outbox_killed_service", *killed_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr
    ids = killed.stdout.split()
    assert len(ids) == 25
    assert statuses(engine, subject=subject) == dict.fromkeys(ids, "pending")

    outbox = Outbox(broker_url=broker.url, retry_for=0.5)
    comp = outbox.run_compensator(engine, name="app-compensator", **FAST)
    assert compensator_threads("app-compensator")
    try:
        wait_for(
            lambda: set(statuses(engine, subject=subject).values()) == {"sent"},
            timeout=30,
            what="the killed process's rows sent",
        )
    finally:
        assert outbox.close(drain_timeout=10)
    assert comp.metrics.sent._value.get() == 25
    wait_for(lambda: not compensator_threads("app-compensator"), what="compensator stopped")
    with BrokerClient(broker.url) as client:
        assert stored_ids(client, subject) == Counter(ids)


def test_two_in_process_compensators_share_the_rows_each_row_once(
    engine: sa.Engine, broker: BrokerProcess
) -> None:
    subject = unique_subject("fenced")
    OutboxStore(engine).insert(pending_rows(1500, subject=subject, prefix="f"))
    outboxes = [Outbox(broker_url=broker.url, retry_for=0.5) for _ in range(2)]
    comps = [
        o.run_compensator(engine, name=f"comp-{n}", batch_size=50, **FAST)
        for n, o in enumerate(outboxes)
    ]
    try:
        wait_for(
            lambda: set(statuses(engine, subject=subject).values()) == {"sent"},
            timeout=60,
            what="1500 rows sent",
        )
    finally:
        for outbox in outboxes:
            assert outbox.close(drain_timeout=10)
    sent = [c.metrics.sent._value.get() for c in comps]
    assert sum(sent) == 1500  # fenced by claim token: no row marked by both
    assert all(sent), "both compensators should have taken part"
    assert sum(c.metrics.resent._value.get() for c in comps) == 0  # none sent twice
    with BrokerClient(broker.url) as client:
        assert stored_ids(client, subject) == Counter(f"f-{i}" for i in range(1500))


def test_the_compensators_grace_must_exceed_the_dispatchers_retry_window(
    engine: sa.Engine,
) -> None:
    outbox = Outbox(broker_url="http://127.0.0.1:8931", retry_for=20)
    with pytest.raises(ConfigurationError, match=r"grace .* must exceed the outbox's retry_for"):
        outbox.run_compensator(engine, grace=timedelta(seconds=10))
    assert outbox.close()


async def test_the_in_process_compensator_of_an_async_engine(
    pg_url_migrated: str, engine: sa.Engine, broker: BrokerProcess
) -> None:
    subject = unique_subject("async")
    OutboxStore(engine).insert(pending_rows(10, subject=subject, prefix="a"))
    async_engine = create_async_engine(pg_url_migrated)
    outbox = Outbox(broker_url=broker.url, retry_for=0.5)
    outbox.install(async_engine)
    outbox.run_compensator(async_engine, **FAST)
    try:
        await wait_for_async(
            lambda: set(statuses(engine, subject=subject).values()) == {"sent"},
            within=30,
            what="rows sent",
        )
    finally:
        assert await outbox.aclose()
        await async_engine.dispose()


def test_the_dispatcher_sends_what_it_held_soon_after_the_broker_is_back(
    engine: sa.Engine, broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    late = broker_factory(tmp_path / "late")
    subject = unique_subject("held")
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=late.url)  # no compensator anywhere
    outbox.install(maker)
    ids: list[str] = []
    try:
        for n in range(10):
            with maker.begin() as session:
                ids += [outbox.publish(session, subject, {"n": n, "i": i}) for i in range(3)]
        assert set(statuses(engine, subject=subject).values()) == {"pending"}
        late.start()
        back = time.monotonic()
        wait_for(
            lambda: set(statuses(engine, subject=subject).values()) == {"sent"},
            timeout=25,
            what="the held messages sent",
        )
        assert time.monotonic() - back < 15, "well inside the compensator's 30 s grace"
    finally:
        assert outbox.close(drain_timeout=10)
    with BrokerClient(late.url) as client:
        assert stored_ids(client, subject) == Counter(ids)
    late.stop()


def test_once_names_the_rows_in_their_grace_and_when_the_next_falls_due(
    engine: sa.Engine, pg_url_migrated: str, broker: BrokerProcess
) -> None:
    subject = unique_subject("young")
    store = OutboxStore(engine)
    store.insert(pending_rows(2, subject=subject, age=300, prefix="old"))
    store.insert(pending_rows(3, subject=subject, age=10, prefix="young"))
    urls = ["--database-url", pg_url_migrated, "--broker-url", broker.url]
    started = datetime.now(UTC)
    done = subprocess.run(
        [sys.executable, "-m", "qmq_outbox", "compensator", "--once", "--grace", "30s", *urls],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    counts, waiting = done.stdout.splitlines()
    assert counts.startswith("claimed=2 sent=2 ")
    assert waiting.startswith("in_grace=3 retrying=0 next_due=")
    due = datetime.fromisoformat(waiting.split("next_due=")[1].split()[0])
    expected = started + timedelta(seconds=20)  # created 10 s ago, 30 s of grace
    assert abs((due - expected).total_seconds()) < 5
    assert "--grace is 30s" in waiting
    assert statuses(engine, subject=subject) == {
        **dict.fromkeys(["old-0", "old-1"], "sent"),
        **dict.fromkeys(["young-0", "young-1", "young-2"], "pending"),
    }
