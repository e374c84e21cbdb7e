"""Ours: ``Outbox`` on a SQLAlchemy ``Session``, a ``qmq broker`` process (its default
``--fsync always``), ``qmq compensator`` beside the app (docs/outbox.md: one must run), and a
worker running ``Consumer`` + ``IdempotentStore(batch_size=32)`` (docs/consumer.md)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from bench._broker import BenchBroker
from bench._flow.common import (
    INSERT_EFFECT,
    INSERT_ORDER,
    Deployment,
    RolledBack,
    System,
    warm,
    with_children,
)
from qmq_outbox import Consumer, IdempotentStore, Message, migrate
from qmq_outbox.outbox import Outbox

SUBJECT = "flow.order"
GROUP = "flow"
STORE_BATCH = 32
COMPENSATOR = (sys.executable, "-m", "qmq_outbox", "compensator")  # `qmq compensator`
PREFETCH = 64  # docs/consumer.md: at least batch_size, for batches to form


def install(db_url: str) -> None:
    migrate.upgrade(db_url)


@contextmanager
def deploy(db_url: str, workdir: Path) -> Iterator[Deployment]:
    broker = BenchBroker(workdir / "broker", "--log-level", "warning")
    broker.start()
    log = open(workdir / "compensator.log", "wb")  # noqa: SIM115 - the child's, closed below
    compensator = subprocess.Popen(
        [*COMPENSATOR, "--database-url", db_url, "--broker-url", broker.url],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        assert broker.proc is not None
        broker_process = psutil.Process(broker.proc.pid)
        compensator_process = psutil.Process(compensator.pid)
        yield Deployment(
            config={"broker_url": broker.url},
            roles={
                "broker": lambda: with_children(broker_process),
                "compensator": lambda: with_children(compensator_process),
            },
        )
        if compensator.poll() is not None:
            raise RuntimeError(f"qmq compensator exited with {compensator.returncode}")
    finally:
        compensator.terminate()
        try:
            compensator.wait(30)
        except subprocess.TimeoutExpired:
            compensator.kill()
        log.close()
        broker.stop()


class OutboxService:
    def __init__(self, db_url: str, broker_url: str, connections: int) -> None:
        self._engine = sa.create_engine(db_url, pool_size=connections)
        self._maker = sessionmaker(self._engine)
        self._outbox = Outbox(broker_url=broker_url, app="flow")
        self._outbox.install(self._engine)
        warm(self._engine, connections)

    def transaction(self, order_id: int, *, rollback: bool) -> None:
        with self._maker.begin() as session:
            session.execute(INSERT_ORDER, {"id": order_id, "amount": 1})
            self._outbox.publish(session, SUBJECT, {"order": order_id})
            if rollback:
                raise RolledBack

    def close(self) -> None:
        self._outbox.close(drain_timeout=30)
        self._engine.dispose()


def worker(db_url: str, config: dict[str, str], ready: Any) -> None:
    """Runs until SIGTERM (``Consumer.run`` installs the handler and stops gracefully)."""
    engine = sa.create_engine(db_url, pool_size=10)
    store = IdempotentStore(sessionmaker(engine), batch_size=STORE_BATCH)
    consumer = Consumer(config["broker_url"], GROUP, prefetch=PREFETCH)

    @consumer.handler(SUBJECT, idempotent=store)
    def effect(message: Message, session: Session) -> None:
        started = time.time()
        session.execute(INSERT_EFFECT, {"order_id": message.json()["order"], "started_at": started})

    ready.set()
    consumer.run()
    engine.dispose()


SYSTEM = System(
    name="qmq",
    title="qmq outbox",
    install=install,
    deploy=deploy,
    service=lambda db_url, config, n: OutboxService(db_url, config["broker_url"], n),
    worker=worker,
    note="qmq outbox: this checkout; `with Session.begin()`: business row + `Outbox.publish`"
    " (SQLAlchemy, psycopg), the default dispatcher; `qmq broker` (default `--fsync always`)"
    " and `qmq compensator` (defaults) as processes of their own; the worker"
    f" `Consumer(prefetch={PREFETCH})` (other settings default) with"
    f" `IdempotentStore(batch_size={STORE_BATCH})`, the effect written in the store's"
    " transaction with the dedup row",
)
