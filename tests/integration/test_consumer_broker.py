"""The consumer against a real broker process and PostgreSQL: retries, dead letters,
redelivery deduplicated by IdempotentStore, twins, broadcast."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import BrokerClient, BrokerRejected, Consumer, IdempotentStore, Message, RetryLater
from qmq_outbox.schema import consumed_table
from tests.integration.consumer_support import (
    consumer_database,
    count,
    effects,
    group_state,
    invoices,
    produce,
    reset,
    running,
    unique,
    wait_for,
)
from tests.support.broker_process import BrokerProcess

FAST = ["--ack-timeout", "1s", "--max-attempts", "3"]


@pytest.fixture(scope="module")
def db_url(pg_admin_url: str) -> Iterator[str]:
    with consumer_database(pg_admin_url) as url:
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = sa.create_engine(db_url, pool_size=10)
    reset(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def fast_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker for the module (each test has its own subjects)."""
    broker = BrokerProcess(tmp_path_factory.mktemp("consumer") / "broker", extra_args=FAST)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def client(fast_broker: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(fast_broker.url) as client:
        yield client


def _consumer(url: str, group: str, **kwargs: object) -> Consumer:
    settings: dict[str, object] = {"wait_ms": 200, "ack_interval": 0.02, "shutdown_timeout": 10}
    settings.update(kwargs)
    return Consumer(url, group, **settings)  # type: ignore[arg-type]


def _bill(message: Message, session: Session) -> None:
    body = message.json()
    session.execute(
        sa.insert(invoices).values(order_id=body["order_id"], message_id=message.id, amount=10)
    )


def test_a_failing_handler_is_retried_with_the_next_attempt_then_dead_lettered(
    fast_broker: BrokerProcess, client: BrokerClient
) -> None:
    subject, group = unique("orders"), "billing"
    (message_id,) = produce(client, subject, [b'{"order_id": "o-1"}'])
    attempts: list[int] = []

    def handler(message: Message) -> None:
        attempts.append(message.attempt)
        if message.attempt == 2:
            raise RetryLater(0.05, "short backoff for the test")
        raise RuntimeError(f"downstream down (attempt {message.attempt})")

    consumer = _consumer(fast_broker.url, group)
    consumer.add_handler(subject, handler)
    with running(consumer):
        dead = wait_for(lambda: _dead(client, subject, group), what="the dead letter")
    assert attempts == [1, 2, 3]
    assert len(dead) == 1
    assert dead[0]["message"]["id"] == message_id
    assert dead[0]["attempts"] == 3
    assert "attempt 3" in dead[0]["error"]
    assert consumer.stats().nacked == 3
    assert group_state(client, subject, group)["dead"] == 1


def _dead(client: BrokerClient, subject: str, group: str) -> list[dict[str, Any]]:
    try:
        return list(client.dead_letters(subject, group)["dead"])
    except BrokerRejected as exc:  # the group is not known before its first pull
        if exc.status == 404:
            return []
        raise


def test_a_message_redelivered_after_its_effect_committed_is_skipped(
    fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    """A consumer that committed and died before acking: the redelivery finds its row."""
    subject, group = unique("orders"), "billing"
    store = IdempotentStore(sessionmaker(engine))
    produce(client, subject, [b'{"order_id": "o-1"}'])
    (first,) = client.pull(subject, group, "crashed-before-ack", max_messages=1)
    store.process(group, first, _bill)  # committed; the ack never went out

    calls: list[int] = []

    def bill(message: Message, session: Session) -> None:
        calls.append(message.attempt)
        _bill(message, session)

    consumer = _consumer(fast_broker.url, group)
    consumer.add_handler(subject, bill, idempotent=store)
    with running(consumer):
        wait_for(lambda: consumer.stats().duplicates == 1, what="the redelivery")
        wait_for(lambda: group_state(client, subject, group)["acked"] == 1, what="the ack")
    assert calls == [], "the redelivered message must not run the handler again"
    assert count(engine, invoices) == 1


def test_lease_expiry_while_the_first_holder_still_runs_gives_one_effect(
    fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    """Two consumers hold the same message at once: the second's dedup insert waits on the
    first's uncommitted row, then finds it committed, and skips."""
    subject, group = unique("orders"), "billing"
    store = IdempotentStore(sessionmaker(engine))
    produce(client, subject, [b'{"order_id": "o-1"}'])
    first_inside = threading.Event()
    release_first = threading.Event()
    handled_by: list[tuple[str, int]] = []

    def slow_bill(message: Message, session: Session) -> None:
        handled_by.append(("a", message.attempt))
        _bill(message, session)
        first_inside.set()
        release_first.wait(20)  # outlives the 1 s lease

    def bill(message: Message, session: Session) -> None:
        handled_by.append(("b", message.attempt))
        _bill(message, session)

    a = _consumer(fast_broker.url, group, consumer_id="a", concurrency=1, prefetch=0)
    a.add_handler(subject, slow_bill, idempotent=store)
    b = _consumer(fast_broker.url, group, consumer_id="b", concurrency=1, prefetch=0)
    b.add_handler(subject, bill, idempotent=store)
    with running(a):
        assert first_inside.wait(10)
        with running(b):
            wait_for(lambda: b.stats().pulled == 1, what="the redelivery to b")
            wait_for(lambda: _blocked_on_a_lock(engine), what="b waiting on a's dedup row")
            release_first.set()
            wait_for(lambda: b.stats().duplicates == 1, what="b skipping the duplicate")
            wait_for(lambda: a.stats().processed == 1)
            wait_for(lambda: group_state(client, subject, group)["in_flight"] == 0)
    assert handled_by == [("a", 1)]
    assert count(engine, invoices) == 1
    assert group_state(client, subject, group)["acked"] == 1


def _blocked_on_a_lock(engine: Engine) -> bool:
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    with engine.connect() as conn:
        return bool(conn.execute(query).scalar_one())


def test_a_rolled_back_handler_leaves_nothing_and_the_retry_succeeds(
    fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    subject, group = unique("orders"), "billing"
    store = IdempotentStore(sessionmaker(engine))
    produce(client, subject, [b'{"order_id": "o-9"}'])

    def flaky(message: Message, session: Session) -> None:
        _bill(message, session)
        if message.attempt == 1:
            raise RetryLater(0.05, "rolled back")

    consumer = _consumer(fast_broker.url, group)
    consumer.add_handler(subject, flaky, idempotent=store)
    with running(consumer):
        wait_for(lambda: group_state(client, subject, group)["acked"] == 1)
    assert count(engine, invoices) == 1
    assert consumer.stats().nacked == 1
    assert consumer.stats().processed == 1


def test_many_messages_many_batching_consumers_each_effect_once(
    fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    subject, group = unique("orders"), "billing"
    store = IdempotentStore(sessionmaker(engine), batch_size=16)
    produce(client, subject, [f'{{"order_id": "o-{i}"}}'.encode() for i in range(200)])
    consumers = [
        _consumer(fast_broker.url, group, consumer_id=f"c{i}", prefetch=32) for i in range(3)
    ]
    for consumer in consumers:
        consumer.add_handler(subject, _bill, idempotent=store)
    with running(*consumers):
        wait_for(lambda: group_state(client, subject, group)["acked"] == 200)
    assert count(engine, invoices) == 200
    assert sum(c.stats().processed for c in consumers) == 200


def _requests(broker: BrokerProcess, endpoint: str) -> int:
    """How many requests to ``endpoint`` the broker answered 200, from its metrics."""
    metrics = httpx.get(f"{broker.url}/metrics", timeout=5).text
    pattern = rf'^qmq_broker_request_seconds_count{{endpoint="{endpoint}",status="200"}} (\S+)$'
    found = re.search(pattern, metrics, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def test_a_trickle_costs_one_pull_a_message_with_the_acks_riding_on_the_pulls(
    broker: BrokerProcess, engine: Engine
) -> None:
    """Messages one at a time, closer together than ``ack_interval``: the pull that follows
    a message carries its ack and waits for the next one, so each message costs one pull
    and no ack request of its own (not a pull to get it and another to ack it)."""
    subject, group, sent = unique("orders"), "billing", 30
    consumer = _consumer(broker.url, group, ack_interval=1.0, wait_ms=5000)
    consumer.add_handler(subject, _bill, idempotent=IdempotentStore(sessionmaker(engine)))
    with BrokerClient(broker.url) as client, running(consumer):
        for i in range(sent):
            produce(client, subject, [f'{{"order_id": "t-{i}"}}'.encode()])
            wait_for(lambda i=i: count(engine, invoices) == i + 1)
            time.sleep(0.02)
        wait_for(lambda: group_state(client, subject, group)["acked"] == sent)
        pulls, acks = _requests(broker, "pull"), _requests(broker, "ack")
    assert count(engine, invoices) == sent
    # each message waited for before the next: at least a pull each, and about no more
    assert sent <= pulls <= sent + 3, f"{pulls} pulls for {sent} messages"
    assert acks <= 1, f"{acks} ack requests: the acks should ride on the pulls"


def test_broadcast_gives_every_consumer_of_the_group_every_message(
    fast_broker: BrokerProcess, client: BrokerClient
) -> None:
    subject, group = unique("cache"), "cache-invalidation"
    ids = produce(client, subject, [b"{}" for _ in range(10)])
    seen: dict[str, list[str]] = {"n1": [], "n2": [], "n3": []}
    lock = threading.Lock()
    consumers = []
    for node in seen:
        consumer = _consumer(fast_broker.url, group, consumer_id=node, mode="broadcast")

        def handler(message: Message, node: str = node) -> None:
            with lock:
                seen[node].append(message.id)

        consumer.add_handler(subject, handler)
        consumers.append(consumer)
    with running(*consumers):
        wait_for(lambda: all(len(v) >= 10 for v in seen.values()), what="every node")
        wait_for(lambda: all(c.stats().acked == 10 for c in consumers), what="acks")
    for node, got in seen.items():
        assert sorted(got) == sorted(ids), node


def test_broadcast_with_the_store_applies_every_message_on_every_consumer(
    fast_broker: BrokerProcess, client: BrokerClient, engine: Engine
) -> None:
    """Each broadcast consumer dedups on its own rows: both apply each message once."""
    subject, group = unique("prices"), "price-cache"
    produce(client, subject, [b"{}" for _ in range(5)])
    store = IdempotentStore(sessionmaker(engine))
    consumers = []
    for node in ("n1", "n2"):
        consumer = _consumer(fast_broker.url, group, consumer_id=node, mode="broadcast")

        def apply(message: Message, session: Session, node: str = node) -> None:
            session.execute(sa.insert(effects).values(message_id=f"{node}/{message.id}", attempt=1))

        consumer.add_handler(subject, apply, idempotent=store)
        consumers.append(consumer)
    with running(*consumers):
        wait_for(lambda: all(c.stats().acked == 5 for c in consumers), what="acks")
    assert count(engine, effects) == 10
    with engine.connect() as conn:
        groups = set(conn.execute(sa.select(consumed_table.c.consumer_group)).scalars())
    assert groups == {"price-cache@n1", "price-cache@n2"}
