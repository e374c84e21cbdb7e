"""A real consumer process on each transport, killed with SIGKILL mid-work: the orders are
billed exactly once all the same (the idempotent store is in the consumer's database)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message
from qmq_outbox.schema import consumed_table
from tests.integration.consumer_support import count, invoices, running, wait_for
from tests.transports.kits import Kit
from tests.transports.test_consumer import produce

pytestmark = pytest.mark.timeout(90)


class Victim:
    def __init__(self, proc: subprocess.Popen[bytes], markers: Path, log: Path) -> None:
        self.proc, self.markers, self.log = proc, markers, log

    def started(self, order: str, attempt: int = 1) -> bool:
        return (self.markers / f"started-{order}-{attempt}").exists()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


Spawn = Callable[..., Victim]


@pytest.fixture
def spawn(kit: Kit, transports_db: str, tmp_path: Path) -> Iterator[Spawn]:
    victims: list[Victim] = []

    def start(subject: str, group: str, *extra: str) -> Victim:
        markers = tmp_path / f"markers-{len(victims)}"
        markers.mkdir()
        log = tmp_path / f"consumer-{len(victims)}.log"
        command = [
            sys.executable,
            "-m",
            "tests.transports.consumer_app",
            "--broker",
            kit.url(),
            "--db",
            transports_db,
            "--subject",
            subject,
            "--group",
            group,
            "--markers",
            str(markers),
            *extra,
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        victim = Victim(proc, markers, log)
        victims.append(victim)
        wait_for(lambda: (markers / "ready").exists() or proc.poll() is not None)
        assert proc.poll() is None, victim.log_tail()
        return victim

    yield start
    for victim in victims:
        if victim.proc.poll() is None:
            victim.kill9()


def follower(kit: Kit, group: str, subject: str, engine: Engine) -> Consumer:
    """An in-process consumer of the same group taking over, with the same store."""
    consumer = Consumer(transport=kit.transport(), group=group, wait_ms=200, ack_interval=0.02)

    def bill(message: Message, session: Session) -> None:
        order = message.json()["order_id"]
        session.execute(sa.insert(invoices).values(order_id=order, message_id=message.id, amount=1))

    consumer.add_handler(subject, bill, idempotent=IdempotentStore(sessionmaker(engine)))
    return consumer


def test_kill9_mid_handler_is_redelivered_and_billed_once(
    kit: Kit, spawn: Spawn, engine: Engine
) -> None:
    subject, group = kit.subject(), kit.group()
    kit.prepare(subject, group)
    produce(kit.transport(), subject, [f"o-{i}" for i in range(4)])
    victim = spawn(subject, group, "--hang", "o-1", "--concurrency", "2")
    wait_for(lambda: count(engine, invoices) == 3, what="the other three billed")
    wait_for(lambda: victim.started("o-1"), what="o-1 hanging")
    victim.kill9()
    assert count(engine, invoices) == 3  # o-1's uncommitted insert died with the process

    taking_over = follower(kit, group, subject, engine)
    with running(taking_over):
        wait_for(lambda: count(engine, invoices) == 4, what="o-1 billed after the kill")
    assert taking_over.stats().processed == 1  # o-1; any other copy is a skipped duplicate
    assert count(engine, invoices) == 4
    assert count(engine, consumed_table) == 4


def test_kill9_after_commit_before_ack_is_skipped_on_redelivery(
    kit: Kit, spawn: Spawn, engine: Engine
) -> None:
    subject, group = kit.subject(), kit.group()
    kit.prepare(subject, group)
    produce(kit.transport(), subject, [f"o-{i}" for i in range(5)])
    # Room for all five, a long poll and a long ack interval: no ack leaves before the kill.
    victim = spawn(subject, group, "--ack-interval", "60", "--prefetch", "10", "--wait-ms", "30000")
    wait_for(lambda: count(engine, invoices) == 5, what="all five committed")
    victim.kill9()

    taking_over = follower(kit, group, subject, engine)
    with running(taking_over):
        wait_for(lambda: taking_over.stats().duplicates == 5, what="five redeliveries skipped")
    assert taking_over.stats().processed == 0
    assert count(engine, invoices) == 5
