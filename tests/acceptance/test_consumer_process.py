"""A real consumer process, killed with SIGKILL or stopped with SIGTERM mid-work, against a
real broker and PostgreSQL: nothing is lost, nothing is done twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from qmq_outbox import BrokerClient, Consumer, IdempotentStore, Message
from qmq_outbox.schema import consumed_table
from tests.integration.consumer_support import (
    consumer_database,
    count,
    effects,
    group_state,
    invoices,
    produce,
    record_effect,
    reset,
    running,
    unique,
    wait_for,
)
from tests.support.broker_process import BrokerProcess

ACK_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def fast_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(
        tmp_path_factory.mktemp("consumer-process") / "broker",
        extra_args=["--ack-timeout", f"{ACK_TIMEOUT}s", "--max-attempts", "5"],
    )
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def client(fast_broker: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(fast_broker.url) as client:
        yield client


@pytest.fixture(scope="module")
def db_url(pg_admin_url: str) -> Iterator[str]:
    with consumer_database(pg_admin_url) as url:
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = sa.create_engine(db_url)
    reset(engine)
    yield engine
    engine.dispose()


class ConsumerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], markers: Path, log: Path) -> None:
        self.proc, self.markers, self.log = proc, markers, log

    def started(self) -> set[tuple[int, int]]:
        found = set()
        for marker in self.markers.glob("started-*"):
            _, seq, attempt = marker.name.split("-")
            found.add((int(seq), int(attempt)))
        return found

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


Spawn = Callable[..., ConsumerProcess]


@pytest.fixture
def spawn(fast_broker: BrokerProcess, db_url: str, tmp_path: Path) -> Iterator[Spawn]:
    procs: list[ConsumerProcess] = []

    def start(subject: str, group: str, *extra: str) -> ConsumerProcess:
        markers = tmp_path / f"markers-{len(procs)}"
        markers.mkdir()
        log = tmp_path / f"consumer-{len(procs)}.log"
        cmd = [
            sys.executable,
            "-m",
            "tests.acceptance.consumer_app",
            "--broker",
            fast_broker.url,
            "--db",
            db_url,
            "--subject",
            subject,
            "--group",
            group,
            "--markers",
            str(markers),
            *extra,
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        process = ConsumerProcess(proc, markers, log)
        procs.append(process)
        wait_for(lambda: (markers / "ready").exists() or proc.poll() is not None)
        assert proc.poll() is None, process.log_tail()
        return process

    yield start
    for process in procs:
        if process.proc.poll() is None:
            process.kill9()


def _orders(n: int) -> list[bytes]:
    return [f'{{"order_id": "o-{i}"}}'.encode() for i in range(n)]


def _follower(url: str, group: str, subject: str, engine: Engine, **kwargs: object) -> Consumer:
    """An in-process consumer taking over after the killed one, same store."""
    consumer = Consumer(url, group, wait_ms=200, ack_interval=0.02, **kwargs)  # type: ignore[arg-type]
    store = IdempotentStore(sessionmaker(engine))

    def bill(message: Message, session: sa.orm.Session) -> None:
        session.execute(
            sa.insert(invoices).values(
                order_id=message.json()["order_id"], message_id=message.id, amount=10
            )
        )

    consumer.add_handler(subject, bill, idempotent=store)
    return consumer


def test_kill9_mid_handler_is_redelivered_after_the_ack_timeout_and_billed_once(
    spawn: Spawn, fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    subject, group = unique("orders"), "billing"
    produce(client, subject, _orders(4))
    victim = spawn(subject, group, "--hang", "1", "--concurrency", "2")
    wait_for(lambda: group_state(client, subject, group)["acked"] == 3, what="the other acks")
    wait_for(lambda: (1, 1) in victim.started(), what="seq 1 hanging")
    victim.kill9()
    assert count(engine, invoices) == 3  # seq 1's uncommitted insert died with the process

    follower = _follower(fast_broker.url, group, subject, engine)
    with running(follower):
        wait_for(lambda: group_state(client, subject, group)["acked"] == 4, what="seq 1 acked")
    assert follower.stats().processed == 1
    assert count(engine, invoices) == 4
    assert count(engine, consumed_table) == 4


def test_kill9_after_commit_before_ack_is_skipped_on_redelivery(
    spawn: Spawn, fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    subject, group = unique("orders"), "billing"
    produce(client, subject, _orders(5))
    # room for all five leases, so no puller hurries the acks: they wait for the interval
    victim = spawn(subject, group, "--ack-interval", "60", "--prefetch", "10")
    wait_for(lambda: count(engine, invoices) == 5, what="all five committed")
    victim.kill9()
    assert group_state(client, subject, group)["acked"] == 0  # the acks never went out

    follower = _follower(fast_broker.url, group, subject, engine)
    with running(follower):
        wait_for(lambda: group_state(client, subject, group)["acked"] == 5, what="acks")
    assert follower.stats().duplicates == 5
    assert follower.stats().processed == 0
    assert count(engine, invoices) == 5


def test_sigterm_mid_batch_finishes_and_acks_what_it_holds(
    spawn: Spawn, client: BrokerClient, engine: Engine
) -> None:
    subject, group = unique("orders"), "billing"
    produce(client, subject, _orders(12))
    consumer = spawn(subject, group, "--slow", "0.3", "--concurrency", "3", "--ack-interval", "60")
    wait_for(lambda: len(consumer.started()) >= 3, what="a batch in flight")
    assert count(engine, invoices) < 12
    assert consumer.terminate() == 0, consumer.log_tail()
    stopped_at = time.monotonic()
    finished = count(engine, invoices)
    assert finished >= 3, "the handlers in flight at SIGTERM must finish"
    assert group_state(client, subject, group)["acked"] == finished  # flushed on stop
    assert group_state(client, subject, group)["in_flight"] == 0

    # Once any lease it might have kept has expired, only never-delivered messages remain.
    time.sleep(max(0.0, stopped_at + ACK_TIMEOUT + 0.3 - time.monotonic()))
    rest = client.pull(subject, group, "checker", max_messages=100, wait_ms=0)
    assert len(rest) == 12 - finished
    assert all(m.attempt == 1 for m in rest), [(m.seq, m.attempt) for m in rest]
    done_orders = {row for row in _order_ids(engine)}
    assert not done_orders & {m.json()["order_id"] for m in rest}


def _order_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(invoices.c.order_id)).scalars())


def test_non_transactional_crash_is_processed_again_not_skipped(
    spawn: Spawn, fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    subject, group = unique("mail"), "mailer"
    (message_id,) = produce(client, subject, [b'{"order_id": "o-1"}'])
    victim = spawn(subject, group, "--mode", "non_transactional", "--hang", "0", "--lease", "2")
    wait_for(lambda: (0, 1) in victim.started(), what="the effect underway")
    victim.kill9()
    assert count(engine, effects) == 1
    with engine.connect() as conn:
        status = conn.execute(sa.select(consumed_table.c.status)).scalar_one()
    assert status == "processing"  # the claim the dead process left behind

    store = IdempotentStore(sessionmaker(engine))
    follower = Consumer(fast_broker.url, group, wait_ms=200, ack_interval=0.02)
    follower.add_handler(
        subject,
        lambda m: record_effect(engine, m.id, m.attempt),
        idempotent=store.non_transactional(),
    )
    with running(follower):
        wait_for(lambda: group_state(client, subject, group)["acked"] == 1, what="the redo")
    assert count(engine, effects, message_id=message_id) == 2  # at least once: never skipped
    with engine.connect() as conn:
        assert conn.execute(sa.select(consumed_table.c.status)).scalar_one() == "done"
