"""Ordered handlers (``@consumer.handler(subject, ordered=True)``) against real broker
processes and PostgreSQL (docs/consumer.md, "Ordered handlers").

Every key's messages carry their number n; the handlers append ``(key, n)`` to a ledger in
the idempotent store's transaction (``ordered_consumer_app``). Per key, the ledger must read
0, 1, 2, ... in the order its rows committed: no gap, no duplicate, nothing out of order,
through handler failures, a consumer killed with SIGKILL, and a split while consuming.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import (
    AsyncBrokerClient,
    BrokerClient,
    Consumer,
    IdempotentStore,
    Message,
    OutgoingMessage,
    RetryLater,
)
from qmq_wire.ordered import logic_partition
from tests.integration.consumer_support import consumer_database, running, unique, wait_for
from tests.integration.ordered_consumer_app import ledger, ledger_tables, recorder
from tests.support.broker_process import BrokerProcess

pytestmark = pytest.mark.timeout(180)

BROKER_FLAGS = ["--ack-timeout", "2s", "--partition-lease", "1s", "--max-attempts", "50"]
GROUP = "ledger"


@pytest.fixture(scope="module")
def db_url(pg_admin_url: str) -> Iterator[str]:
    with consumer_database(pg_admin_url) as url:
        engine = sa.create_engine(url)
        ledger_tables.create_all(engine)
        engine.dispose()
        yield url


@pytest.fixture(scope="module")
def engine(db_url: str) -> Iterator[Engine]:
    engine = sa.create_engine(db_url, pool_size=20)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def ordered_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker for the module (each test has its own subject)."""
    broker = BrokerProcess(tmp_path_factory.mktemp("ordered") / "data", extra_args=BROKER_FLAGS)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def client(ordered_broker: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(ordered_broker.url) as client:
        yield client


# -- helpers --------------------------------------------------------------------------------


def publish(
    client: BrokerClient, subject: str, keys: list[str], numbers: range
) -> dict[int, set[str]]:
    """Each key's messages ``numbers``, interleaved across keys, in order per key (a request
    is stored in request order, and the next one is sent once it is answered). Returns the
    keys each partition received."""
    messages = [
        OutgoingMessage(
            id=f"{subject}/{key}/{n}",
            subject=subject,
            key=key,
            body=orjson.dumps({"key": key, "n": n}),
        )
        for n in numbers
        for key in keys
    ]
    placed: dict[int, set[str]] = defaultdict(set)
    for start in range(0, len(messages), 500):
        batch = messages[start : start + 500]
        results = client.produce(batch)
        assert {r.status for r in results} == {"stored"}
        for message, result in zip(batch, results, strict=True):
            assert result.partition is not None
            assert message.key is not None
            placed[result.partition].add(message.key)
    return placed


def ledger_rows(engine: Engine, subject: str) -> list[Any]:
    query = sa.select(ledger).where(ledger.c.subject == subject).order_by(ledger.c.id)
    with engine.connect() as conn:
        return list(conn.execute(query))


def handled(engine: Engine, subject: str) -> int:
    query = sa.select(sa.func.count()).select_from(ledger).where(ledger.c.subject == subject)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def assert_in_order(engine: Engine, subject: str, keys: list[str], count: int) -> None:
    """Per key, the rows in commit order are exactly 0 .. count - 1."""
    per_key: dict[str, list[int]] = defaultdict(list)
    for row in ledger_rows(engine, subject):
        per_key[row.key].append(row.n)
    wrong = {key: ns for key, ns in per_key.items() if ns != list(range(count))}
    assert not wrong, {key: ns[:50] for key, ns in list(wrong.items())[:5]}
    assert sorted(per_key) == sorted(keys)


def wait_handled(engine: Engine, subject: str, total: int, timeout: float = 90.0) -> None:
    wait_for(
        lambda: handled(engine, subject) >= total,
        timeout=timeout,
        what=f"{total} ledger rows of {subject}",
    )


def ordered_consumer(url: str, consumer_id: str, **kwargs: Any) -> Consumer:
    settings: dict[str, Any] = {
        "consumer_id": consumer_id,
        "concurrency": 4,
        "wait_ms": 200,
        "ack_interval": 0.02,
        "shutdown_timeout": 10,
    }
    settings.update(kwargs)
    return Consumer(url, GROUP, **settings)


class Overlaps:
    """Which keys each consumer is running now: a key must never run twice at once in one
    consumer, while different keys, of one partition too, should run side by side."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, set[tuple[int | None, str | None]]] = defaultdict(set)
        self.overlaps: list[tuple[str, int | None, str | None]] = []
        self.most_at_once = 0
        self.most_of_one_partition = 0

    def enter(self, consumer: str, message: Message) -> None:
        with self._lock:
            running = self._running[consumer]
            where = (message.partition, message.key)
            if where in running:
                self.overlaps.append((consumer, *where))
            running.add(where)
            self.most_at_once = max(self.most_at_once, len(running))
            alongside = sum(1 for partition, _ in running if partition == message.partition)
            self.most_of_one_partition = max(self.most_of_one_partition, alongside)

    def leave(self, consumer: str, message: Message) -> None:
        with self._lock:
            self._running[consumer].discard((message.partition, message.key))


def watched(consumer_id: str, overlaps: Overlaps, engine: Engine) -> Any:
    """A store handler recording its ledger row while ``overlaps`` watches it run."""
    record = recorder(consumer_id)

    def handler(message: Message, session: Session) -> None:
        overlaps.enter(consumer_id, message)
        try:
            record(message, session)
            time.sleep(0.001)  # long enough for keys to overlap, if they may
        finally:
            overlaps.leave(consumer_id, message)

    return handler


def declare(client: BrokerClient, partitions: int) -> str:
    subject = unique("ledger")
    routes = client.declare_subject(subject, partitions=partitions)
    assert routes["ordered"] is True
    assert [r["partition"] for r in routes["ranges"]] == list(range(partitions))
    return subject


# -- the tests ------------------------------------------------------------------------------


def test_three_consumers_keep_each_keys_order(
    ordered_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    """50 keys x 40 messages over 4 partitions, 3 consumers: per key 0..39 in order."""
    subject = declare(client, 4)
    keys = [f"k{i}" for i in range(50)]
    assert {logic_partition(k) * 4 // 1024 for k in keys} == {0, 1, 2, 3}  # every partition
    store = IdempotentStore(sessionmaker(engine))
    overlaps = Overlaps()
    consumers = [ordered_consumer(ordered_broker.url, f"c{i}") for i in range(3)]
    for consumer in consumers:
        handler = watched(consumer.consumer_id, overlaps, engine)
        consumer.add_handler(subject, handler, idempotent=store, ordered=True)
    with running(*consumers):
        placed = publish(client, subject, keys, range(20))
        placed_later = publish(client, subject, keys, range(20, 40))
        wait_handled(engine, subject, len(keys) * 40)
    assert sorted(placed) == sorted(placed_later) == [0, 1, 2, 3]
    assert_in_order(engine, subject, keys, 40)
    assert overlaps.overlaps == []
    assert overlaps.most_of_one_partition > 1  # one partition's keys ran side by side
    rows = ledger_rows(engine, subject)
    for row in rows:  # a key stays on the partition its logic partition maps to
        assert row.partition == logic_partition(row.key) * 4 // 1024
    assert sum(c.stats().processed for c in consumers) == len(keys) * 40
    assert all(c.stats().in_flight == 0 for c in consumers)
    assert sum(c.stats().processed > 0 for c in consumers) >= 2  # the partitions were shared


def test_partitions_run_side_by_side_and_one_partitions_messages_never_do(
    ordered_broker: BrokerProcess, client: BrokerClient
) -> None:
    """Two partitions' handlers meet at a barrier (they run at once); the second message of
    a partition does not start while the first one still runs."""
    subject = declare(client, 2)
    first, second = _keys_of_partitions(2)
    meeting = threading.Barrier(2, timeout=10)
    started: list[tuple[str, int]] = []
    release_same = threading.Event()
    lock = threading.Lock()

    def handler(message: Message) -> None:
        body = message.json()
        with lock:
            started.append((body["key"], body["n"]))
        if body["n"] == 0:
            meeting.wait()  # both partitions' first messages must run at the same time
        if body["key"] == first and body["n"] == 0:
            release_same.wait(10)

    consumer = ordered_consumer(ordered_broker.url, "solo", concurrency=4)
    consumer.add_handler(subject, handler, ordered=True)
    with running(consumer):
        publish(client, subject, [first, second], range(3))
        wait_for(lambda: (second, 2) in started, what="the other partition to finish")
        time.sleep(0.3)  # the same partition's next message would have started by now
        with lock:
            assert (first, 1) not in started
        release_same.set()
        wait_for(lambda: len(started) == 6, what="all six messages")
    per_key = defaultdict(list)
    for key, n in started:
        per_key[key].append(n)
    assert per_key == {first: [0, 1, 2], second: [0, 1, 2]}


def _keys_of_partitions(partitions: int) -> list[str]:
    """One key for each partition of a subject declared with ``partitions``."""
    found: dict[int, str] = {}
    for i in itertools.count():
        key = f"key-{i}"
        found.setdefault(logic_partition(key) * partitions // 1024, key)
        if len(found) == partitions:
            return [found[p] for p in range(partitions)]
    raise AssertionError("unreachable")


def test_a_failure_is_retried_and_nothing_after_it_runs_first(
    ordered_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    """Some messages fail once (RetryLater, or an exception and the broker's backoff):
    each comes back, and no later message of its key ran before it succeeded."""
    subject = declare(client, 2)
    keys = [f"f{i}" for i in range(12)]
    store = IdempotentStore(sessionmaker(engine))
    runs: dict[str, list[tuple[int, int, bool]]] = defaultdict(list)  # key -> (n, attempt, ok)
    failed_once: set[tuple[str, int]] = set()
    lock = threading.Lock()

    def fail_some(message: Message) -> None:
        body = message.json()
        key, n = body["key"], body["n"]
        with lock:
            first_run = (key, n) not in failed_once
            fails = first_run and (n % 5 == 2 or (key == "f0" and n == 0))
            runs[key].append((n, message.attempt, not fails))
            if fails:
                failed_once.add((key, n))
        if fails and key == "f0" and n == 0:
            # f0/0 is its partition's first message, so this is attempt 1: backoff 1 s
            raise RuntimeError("downstream down: the broker's backoff applies")
        if fails:
            raise RetryLater(0.05, "downstream busy")

    consumers = [ordered_consumer(ordered_broker.url, f"r{i}") for i in range(2)]
    for consumer in consumers:
        handler = recorder(consumer.consumer_id, fail_some)
        consumer.add_handler(subject, handler, idempotent=store, ordered=True)
    with running(*consumers):
        publish(client, subject, keys, range(15))
        wait_handled(engine, subject, len(keys) * 15)
    assert_in_order(engine, subject, keys, 15)
    for key, key_runs in runs.items():
        done = -1
        for n, _, ok in key_runs:
            assert n <= done + 1, (key, key_runs)  # never ahead of a message not yet done
            if ok:
                done = max(done, n)
    retried = [(n, a) for key in keys for n, a, ok in runs[key] if n % 5 == 2 and ok]
    assert len(retried) == len(keys) * 3  # n = 2, 7 and 12 of every key
    assert all(attempt >= 2 for _, attempt in retried)
    assert sum(c.stats().nacked for c in consumers) >= len(failed_once)


def test_a_killed_consumers_partitions_move_to_the_others(
    ordered_broker: BrokerProcess, client: BrokerClient, engine: Engine, db_url: str, tmp_path: Path
) -> None:
    """A consumer process is killed with SIGKILL mid-run: after the partition lease (1 s) and
    the ack timeout (2 s) the others take its partitions over, and every key stays in order."""
    subject = declare(client, 4)
    keys = [f"v{i}" for i in range(40)]
    publish(client, subject, keys, range(30))
    started = tmp_path / "victim-started"
    log = tmp_path / "victim.log"
    command = [
        sys.executable,
        "-m",
        "tests.integration.ordered_consumer_app",
        "--broker",
        ordered_broker.url,
        "--db",
        db_url,
        "--subject",
        subject,
        "--group",
        GROUP,
        "--consumer-id",
        "victim",
        "--started",
        str(started),
    ]
    with open(log, "wb") as out:
        victim = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(started.exists, timeout=30, what="the victim's first message")
        store = IdempotentStore(sessionmaker(engine))
        survivors = [ordered_consumer(ordered_broker.url, f"s{i}") for i in range(2)]
        for consumer in survivors:
            handler = recorder(consumer.consumer_id)
            consumer.add_handler(subject, handler, idempotent=store, ordered=True)
        with running(*survivors):
            wait_for(
                lambda: _rows_of(engine, subject, "victim") >= 50,
                timeout=30,
                what="the victim to handle some messages",
            )
            victim.kill()  # SIGKILL
            victim.wait(10)
            publish(client, subject, keys, range(30, 40))
            wait_handled(engine, subject, len(keys) * 40)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
    assert_in_order(engine, subject, keys, 40)
    by_victim = _rows_of(engine, subject, "victim")
    assert 50 <= by_victim < len(keys) * 30
    rows = ledger_rows(engine, subject)
    last_by_victim: dict[int, int] = {}
    for row in rows:
        if row.consumer == "victim":
            last_by_victim[row.partition] = row.id
    for partition, last in last_by_victim.items():  # each went on with a survivor
        assert any(r.partition == partition and r.id > last for r in rows), partition
    assert sum(c.stats().processed for c in survivors) == len(keys) * 40 - by_victim


def _rows_of(engine: Engine, subject: str, consumer: str) -> int:
    query = (
        sa.select(sa.func.count())
        .select_from(ledger)
        .where(ledger.c.subject == subject, ledger.c.consumer == consumer)
    )
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def test_order_holds_across_a_split_and_a_merge_while_consuming(
    ordered_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    """Partition 0 is split while its backlog is being consumed, and later the two halves
    merged: the messages published after each change (on the new partitions) come after the
    older ones of the same key."""
    subject = declare(client, 2)
    keys = [f"s{i}" for i in range(30)]
    store = IdempotentStore(sessionmaker(engine))
    consumers = [ordered_consumer(ordered_broker.url, f"t{i}") for i in range(2)]
    for consumer in consumers:
        handler = recorder(consumer.consumer_id, lambda message: time.sleep(0.002))
        consumer.add_handler(subject, handler, idempotent=store, ordered=True)
    with running(*consumers):
        publish(client, subject, keys, range(20))
        wait_for(lambda: handled(engine, subject) >= 50, what="consuming to start")
        split = client.split_partition(subject, partition=0, at=256)
        assert split["version"] == 2
        assert [(r["lo"], r["hi"], r["partition"]) for r in split["ranges"]] == [
            (0, 256, 2),
            (256, 512, 3),
            (512, 1024, 1),
        ]
        assert handled(engine, subject) < len(keys) * 20  # the split came mid-backlog
        after_split = publish(client, subject, keys, range(20, 30))
        assert 0 not in after_split
        merged = client.merge_partitions(subject, partitions=[2, 3])
        assert [(r["lo"], r["hi"], r["partition"]) for r in merged["ranges"]] == [
            (0, 512, 4),
            (512, 1024, 1),
        ]
        after_merge = publish(client, subject, keys, range(30, 40))
        assert sorted(after_merge) == [1, 4]
        wait_handled(engine, subject, len(keys) * 40)
        wait_for(
            lambda: _group_version(client, subject) == 3,
            what="the group to reach route version 3",
        )
    assert_in_order(engine, subject, keys, 40)
    partitions_used = {row.partition for row in ledger_rows(engine, subject)}
    assert partitions_used == {0, 1, 2, 3, 4}


def _group_version(client: BrokerClient, subject: str) -> int | None:
    for entry in client.routes(subject)["groups"]:
        if entry["group"] == GROUP:
            return entry["version"]
    return None


def test_async_ordered_handlers_keep_each_keys_order(
    ordered_broker: BrokerProcess, client: BrokerClient
) -> None:
    """``run_async()`` with a coroutine handler registered with ``ordered=True``."""
    subject = declare(client, 3)
    keys = [f"a{i}" for i in range(10)]
    publish(client, subject, keys, range(20))
    seen: dict[str, list[int]] = defaultdict(list)
    running_now: set[str | None] = set()
    overlaps: list[str | None] = []

    async def main() -> None:
        consumer = ordered_consumer(ordered_broker.url, "async-1")

        @consumer.handler(subject, ordered=True)
        async def handle(message: Message) -> None:
            if message.key in running_now:
                overlaps.append(message.key)
            running_now.add(message.key)
            await asyncio.sleep(0.001)
            body = message.json()
            seen[body["key"]].append(body["n"])
            running_now.discard(message.key)

        task = asyncio.create_task(consumer.run_async(install_signal_handlers=False))
        deadline = time.monotonic() + 60
        while sum(map(len, seen.values())) < len(keys) * 20:
            assert time.monotonic() < deadline, "the async consumer fell behind"
            assert not task.done(), task
            await asyncio.sleep(0.02)
        consumer.stop()
        await task
        async with AsyncBrokerClient(ordered_broker.url) as own:
            assert (await own.routes(subject))["groups"] == [{"group": GROUP, "version": 1}]

    asyncio.run(main())
    assert dict(seen) == {key: list(range(20)) for key in keys}
    assert overlaps == []
