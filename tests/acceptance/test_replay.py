"""Replay against real broker processes: a group reset to a time gets exactly the messages
stored at or after it, across kill -9 and a clean restart; a reset by seq; 409 while leases
are out, and force; a replay into a new group with an ``IdempotentStore`` on PostgreSQL runs
every handler once more, while one into the same group is deduplicated."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_broker.format.index import INDEX_CHUNK_ENTRIES
from qmq_outbox import BrokerClient, Consumer, IdempotentStore, Message, OutgoingMessage
from qmq_outbox.errors import BrokerRejected
from qmq_wire.ordered import LOGIC_PARTITIONS
from tests.integration.consumer_support import (
    consumer_database,
    count,
    effects,
    invoices,
    record_effect,
    reset,
    running,
    unique,
    wait_for,
)
from tests.support.broker_process import BrokerProcess

BATCH = 1000
BATCHES = 20  # 20,000 messages: the index's first chunk (16,384 entries) is sealed
GROUP = "billing"


def produce_batches(client: BrokerClient, subject: str) -> None:
    for b in range(BATCHES):
        batch = [
            OutgoingMessage(id=f"m-{b * BATCH + i}", subject=subject, body=b"{}")
            for i in range(BATCH)
        ]
        assert {r.status for r in client.produce(batch)} == {"stored"}
        time.sleep(0.002)  # each batch has a stored time of its own


def drain(client: BrokerClient, subject: str, group: str = GROUP) -> list[Message]:
    """Everything the group is served now, acked; each message must come once."""
    out: list[Message] = []
    while batch := client.pull(subject, group, "c1", max_messages=1000):
        out.extend(batch)
        client.ack(subject, group, "c1", [m.seq for m in batch])
    assert len({m.seq for m in out}) == len(out)
    return out


def since(messages: list[Message], moment: datetime) -> list[str]:
    """The ids of the messages stored at or after ``moment``, in seq order."""
    return [m.id for m in messages if m.stored_at is not None and m.stored_at >= moment]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path / "data", extra_args=["--ack-timeout", "30s"])
    process.start()
    yield process
    process.stop()


def test_a_reset_to_a_time_replays_exactly_what_was_stored_since_across_kill9_and_restart(
    broker: BrokerProcess,
) -> None:
    subject = unique("orders")
    with BrokerClient(broker.url) as client:
        produce_batches(client, subject)
        everything = drain(client, subject)
    assert len(everything) == BATCH * BATCHES
    # a time inside the open index chunk, then one inside the sealed first chunk
    for at in (INDEX_CHUNK_ENTRIES + 617, 5 * BATCH + 1):
        moment = everything[at].stored_at
        assert moment is not None
        expected = since(everything, moment)
        assert expected[0] == f"m-{at - at % BATCH}"  # a batch shares its stored time
        with BrokerClient(broker.url) as client:
            answer = client.reset_group(subject, GROUP, {"time": moment.isoformat()})
        assert answer["positions"][0]["seq"] == at - at % BATCH
        broker.kill9()  # answered means durable: the reset survives
        broker.restart()
        with BrokerClient(broker.url) as client:
            replayed = drain(client, subject)
        assert [m.id for m in replayed] == expected
        assert {m.attempt for m in replayed} == {1}

    # once more through a clean stop: the checkpoint carries the reset group's state
    moment = everything[-1].stored_at
    assert moment is not None
    with BrokerClient(broker.url) as client:
        client.reset_group(subject, GROUP, {"time": moment.isoformat()})
    assert broker.terminate() == 0
    broker.restart()
    with BrokerClient(broker.url) as client:
        assert [m.id for m in drain(client, subject)] == since(everything, moment)
        assert client.subject(subject)["groups"][0]["backlog"] == 0


def test_a_reset_by_seq_and_a_forced_one_survive_kill9(broker: BrokerProcess) -> None:
    subject = unique("orders")
    with BrokerClient(broker.url) as client:
        client.produce([OutgoingMessage(id=f"m-{i}", subject=subject, body=b"") for i in range(10)])
        drain(client, subject)
        client.reset_group(subject, GROUP, {"seq": 7})
    broker.kill9()
    broker.restart()
    with BrokerClient(broker.url) as client:
        assert [m.seq for m in drain(client, subject)] == [7, 8, 9]
        leased = client.pull(subject, GROUP, "c1", max_messages=10)
        assert leased == []
        client.reset_group(subject, GROUP, {"seq": 4})
        leased = client.pull(subject, GROUP, "c1", max_messages=3)
        assert [m.seq for m in leased] == [4, 5, 6]
        with pytest.raises(BrokerRejected) as refused:
            client.reset_group(subject, GROUP, {"seq": 0})
        assert (refused.value.status, refused.value.code, refused.value.field) == (
            409,
            "group_busy",
            "force",
        )
        assert client.reset_group(subject, GROUP, {"seq": 2}, force=True)["dropped_leases"] == 3
    broker.kill9()
    broker.restart()
    with BrokerClient(broker.url) as client:
        # the leases dropped before the crash stay dropped: their acks are unknown
        assert client.ack(subject, GROUP, "c1", [4, 5, 6]) == {"acked": 0, "unknown": [4, 5, 6]}
        assert [(m.seq, m.attempt) for m in drain(client, subject)] == [
            (s, 1) for s in range(2, 10)
        ]


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


def test_a_replay_into_a_new_group_with_an_idempotent_store_runs_every_handler_once_more(
    broker: BrokerProcess, engine: Engine
) -> None:
    subject = unique("orders")
    store = IdempotentStore(sessionmaker(engine))
    runs: dict[str, list[str]] = {}  # group -> ids handled, in order

    def consumer(group: str, **more: object) -> Consumer:
        made = Consumer(
            broker.url, group, wait_ms=200, ack_interval=0.02, shutdown_timeout=10, **more
        )

        @made.handler(subject, idempotent=store)
        def bill(message: Message, session: Session) -> None:
            runs.setdefault(group, []).append(message.id)
            order_id = f"{group}/{message.json()['order']}"
            session.execute(
                sa.insert(invoices).values(order_id=order_id, message_id=message.id, amount=1)
            )
            record_effect(engine, message.id, message.attempt)

        return made

    with BrokerClient(broker.url) as client:
        for n in range(30):
            message = OutgoingMessage(id=f"o-{n}", subject=subject, body=b'{"order": %d}' % n)
            client.produce([message])
            if n == 9:
                time.sleep(0.01)
        first = consumer(GROUP)
        with running(first):
            wait_for(lambda: len(runs.get(GROUP, [])) == 30, what="the first run")
            wait_for(lambda: _acked(client, subject, GROUP) == 30, what="its acks")
        stored = client.pull(subject, "audit", "c1", max_messages=30)
        moment = stored[10].stored_at
        assert moment is not None
        expected = [m.id for m in stored if m.stored_at is not None and m.stored_at >= moment]
        assert expected == [f"o-{n}" for n in range(10, 30)]

        # into the same group: the store has a row for each message, so nothing runs again
        client.reset_group(subject, GROUP, {"time": moment.isoformat()})
        again = consumer(GROUP)
        with running(again):
            wait_for(lambda: again.stats().duplicates == 20, what="the deduplicated replay")
            wait_for(lambda: _acked(client, subject, GROUP) == 50, what="its acks")
        assert len(runs[GROUP]) == 30

        # into a new group from the same time: every handler runs once more, exactly once
        replay = unique("billing-replay")
        fresh = consumer(replay, start={"time": moment.isoformat()})
        with running(fresh):
            wait_for(lambda: len(runs.get(replay, [])) == 20, what="the replay")
            wait_for(lambda: _acked(client, subject, replay) == 20, what="its acks")
        assert sorted(runs[replay]) == sorted(expected)
    assert count(engine, invoices) == 50
    assert count(engine, effects) == 50
    for message_id in expected:
        assert count(engine, effects, message_id=message_id) == 2


def _acked(client: BrokerClient, subject: str, group: str) -> int:
    for entry in client.subject(subject)["groups"]:
        if entry["group"] == group:
            return int(entry["acked"])
    return 0


def test_an_ordered_group_reset_to_a_time_before_a_split_replays_each_key_in_order(
    broker: BrokerProcess,
) -> None:
    """The old partition from the first message stored at or after the time, then the split's
    partitions from their start: per key, n from the time's on, once each and in order,
    across kill -9."""
    subject, keys = unique("ledger"), [f"k{i}" for i in range(20)]

    def publish(client: BrokerClient, n: int) -> None:
        batch = [
            OutgoingMessage(id=f"{k}/{n}", subject=subject, key=k, body=b'{"n": %d}' % n)
            for k in keys
        ]
        assert {r.status for r in client.produce(batch)} == {"stored"}
        time.sleep(0.002)

    def consume(client: BrokerClient) -> dict[str, list[int]]:
        handled: dict[str, list[int]] = {}
        while batch := client.pull(subject, GROUP, "c1", max_messages=100, mode="ordered"):
            for message in batch:
                assert message.key is not None
                handled.setdefault(message.key, []).append(message.json()["n"])
            for partition in {m.partition for m in batch}:
                seqs = [m.seq for m in batch if m.partition == partition]
                client.ack(subject, GROUP, "c1", seqs, partition=partition)
        return handled

    with BrokerClient(broker.url) as client:
        client.declare_subject(subject, partitions=1)
        for n in range(5):
            publish(client, n)
        before = consume(client)
        assert before == {k: [0, 1, 2, 3, 4] for k in keys}
        client.split_partition(subject, partition=0, at=LOGIC_PARTITIONS // 2)
        for n in range(5, 10):
            publish(client, n)
        after = consume(client)
        assert after == {k: [5, 6, 7, 8, 9] for k in keys}
        assert version(client, subject) == 2
        third = client.pull(subject, "audit", "c1", max_messages=100, mode="ordered")
        moment = next(m.stored_at for m in third if m.json()["n"] == 3)
        assert moment is not None
        answer = client.reset_group(subject, GROUP, {"time": moment.isoformat()})
        assert answer["positions"] == [
            {"partition": 0, "consumer": None, "seq": 3 * len(keys)},
            {"partition": 1, "consumer": None, "seq": 0},
            {"partition": 2, "consumer": None, "seq": 0},
        ]
        assert version(client, subject) == 1
    broker.kill9()
    broker.restart()
    with BrokerClient(broker.url) as client:
        assert consume(client) == {k: [3, 4, 5, 6, 7, 8, 9] for k in keys}
        assert version(client, subject) == 2


def version(client: BrokerClient, subject: str) -> int:
    """The route version ``GROUP`` consumes."""
    return next(g["version"] for g in client.routes(subject)["groups"] if g["group"] == GROUP)
