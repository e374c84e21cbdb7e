"""Ordered handlers without a broker process: the lanes' bookkeeping (pure), and the runner's
ordered path against ``InMemoryBroker`` through the real clients: what it sends (pulls in
ordered mode, acks and nacks naming the partition, the failed message and the rest of its
batch in one nack) and when handlers run."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest

from qmq_outbox import Consumer, IdempotentStore, Message, OutgoingMessage, RetryLater
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.consumer.handlers import HandlerSpec
from qmq_outbox.consumer.lanes import Lanes
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.testing import InMemoryBroker, StepClock
from qmq_wire.ordered import logic_partition
from tests.support.messages import delivered
from tests.support.waiting import wait_until

SUBJECT = "ledger.changed"
GROUP = "g"


# -- lanes: pure bookkeeping -------------------------------------------------------------------


def message(seq: int, partition: int | None, subject: str = SUBJECT) -> Message:
    return Message(
        id=f"m-{partition}-{seq}",
        subject=subject,
        seq=seq,
        attempt=1,
        key="k",
        headers={},
        body=b"{}",
        producer=None,
        created_at=None,
        stored_at=None,
        partition=partition,
    )


def test_a_lane_is_scheduled_once_until_it_runs_dry() -> None:
    lanes = Lanes()
    first = lanes.add(message(0, 3))
    assert first is not None
    assert (first.key, first.subject, first.partition) == (f"{SUBJECT}#3", SUBJECT, 3)
    assert lanes.add(message(1, 3)) is None  # already with a worker
    other = lanes.add(message(0, 4))
    assert other is not None
    assert other is not first
    assert len(lanes) == 3
    next_one = lanes.next(first)
    assert next_one is not None
    assert next_one.seq == 0
    assert lanes.add(message(2, 3)) is None  # joins the running lane
    assert [m.seq for m in iter(lambda: lanes.next(first), None)] == [1, 2]
    assert not first.scheduled  # ran dry: the next message schedules a lane anew
    again = lanes.add(message(3, 3))
    assert again is not None
    assert again.scheduled


def test_each_key_of_a_partition_has_a_lane_of_its_own_acked_as_the_partition() -> None:
    lanes = Lanes()
    a = lanes.add(message(0, 3))
    b = lanes.add(dataclasses.replace(message(1, 3), key="other"))
    assert a is not None
    assert b is not None
    assert a is not b  # both go to workers at once
    assert a.key == b.key == f"{SUBJECT}#3"  # their acks name the partition
    assert lanes.add(message(2, 3)) is None  # behind key k's running lane


def test_take_all_empties_every_lane() -> None:
    lanes = Lanes()
    lane = lanes.add(message(0, 0))
    assert lane is not None
    lanes.add(message(1, 0))
    lanes.add(message(5, 1))
    lanes.add(message(9, None, subject="other"))
    taken = {(lane.key): [m.seq for m in rest] for lane, rest in lanes.take_all()}
    assert taken == {f"{SUBJECT}#0": [0, 1], f"{SUBJECT}#1": [5], "other": [9]}
    assert len(lanes) == 0
    assert lanes.take_all() == []


def test_an_ordered_handler_commits_one_message_per_transaction() -> None:
    store: IdempotentStore[Any] = IdempotentStore(lambda: None, batch_size=32)
    shared = HandlerSpec(subject=SUBJECT, fn=lambda m, s: None, guard=store)
    ordered = HandlerSpec(subject=SUBJECT, fn=lambda m, s: None, guard=store, ordered=True)
    assert (shared.batch_limit, ordered.batch_limit) == (32, 1)


def test_ordered_handlers_need_a_shared_mode_consumer() -> None:
    broadcast = Consumer("http://unused", GROUP, mode="broadcast")
    with pytest.raises(ConfigurationError, match="shared-mode"):
        broadcast.add_handler(SUBJECT, lambda m: None, ordered=True)
    shared = Consumer("http://unused", GROUP)

    def handler(message: Message) -> None: ...

    assert shared.handler(SUBJECT, ordered=True)(handler) is handler
    assert shared.subjects == [SUBJECT]


def test_a_message_without_a_partition_keeps_its_subject_as_its_lane() -> None:
    lanes = Lanes()
    lane = lanes.add(delivered("plain", 4, "m-4"))
    assert lane is not None
    assert lane.partition is None
    assert lane.key == lane.subject


# -- the runner against the in-memory broker ---------------------------------------------------


def keys_by_partition(partitions: int) -> list[str]:
    """One key per partition of a subject declared with ``partitions`` (2 or 4)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        key = f"key-{i}"
        found.setdefault(logic_partition(key) * partitions // 1024, key)
        i += 1
    return [found[p] for p in range(partitions)]


def publish(broker: InMemoryBroker, messages: list[tuple[str, int]]) -> None:
    with broker.client() as client:
        client.produce(
            [
                OutgoingMessage(
                    id=f"{key}/{n}",
                    subject=SUBJECT,
                    key=key,
                    body=orjson.dumps({"key": key, "n": n}),
                )
                for key, n in messages
            ]
        )


class Made:
    """Consumers on an ``InMemoryBroker``; their clients are closed after the test."""

    def __init__(self) -> None:
        self.clients: list[BrokerClient | AsyncBrokerClient] = []

    def consumer(self, broker: InMemoryBroker, *, on_loop: bool = False, **kwargs: Any) -> Consumer:
        client = broker.async_client() if on_loop else broker.client()
        self.clients.append(client)
        settings: dict[str, Any] = {
            "consumer_id": "c1",
            "wait_ms": 50,
            "ack_interval": 0.02,
            "shutdown_timeout": 5.0,
        }
        settings.update(kwargs)
        return Consumer("http://unused", GROUP, client=client, **settings)


@pytest.fixture
def made() -> Iterator[Made]:
    made = Made()
    yield made
    for client in made.clients:
        if isinstance(client, AsyncBrokerClient):
            asyncio.run(client.aclose())
        else:
            client.close()


@contextmanager
def running(consumer: Consumer) -> Iterator[None]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            consumer.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="test-ordered-run")
    thread.start()
    try:
        yield
    finally:
        consumer.stop()
        thread.join(10)
        assert not thread.is_alive()
    if errors:
        raise errors[0]


def declared(partitions: int, **options: Any) -> InMemoryBroker:
    broker = InMemoryBroker(**options)
    with broker.client() as client:
        client.declare_subject(SUBJECT, partitions=partitions)
    return broker


def test_each_partition_runs_in_order_and_its_acks_name_it(made: Made) -> None:
    broker = declared(2)
    keys = keys_by_partition(2)
    publish(broker, [(key, n) for n in range(20) for key in keys])
    consumer = made.consumer(broker, concurrency=2, max_batch=8)
    seen: dict[str, list[int]] = {key: [] for key in keys}
    consumer.add_handler(
        SUBJECT, lambda m: seen[m.json()["key"]].append(m.json()["n"]), ordered=True
    )
    with running(consumer):
        wait_until(lambda: sum(map(len, seen.values())) == 40)
        wait_until(lambda: consumer.stats().acked == 40)
    assert seen == {key: list(range(20)) for key in keys}
    for partition in (0, 1):
        assert broker.acked_seqs(SUBJECT, GROUP, partition=partition) == set(range(20))
    pulls = broker.received("pull")
    assert {p["mode"] for p in pulls} == {"ordered"}
    assert not [p for p in pulls if "ack" in p]  # ordered pulls carry no acks
    acks = broker.received("ack")
    assert {a["partition"] for a in acks} == {0, 1}  # one request per partition, each named
    assert sorted(s for a in acks for s in a["seqs"]) == sorted(list(range(20)) * 2)
    assert consumer.stats().in_flight == 0


def test_order_holds_across_a_split_merge_and_move_while_consuming(made: Made) -> None:
    """Route changes in a unit test: the fake changes routes as the broker does, and the
    consumer keeps each key's order through them."""
    broker = declared(2)
    keys = [f"key-{i}" for i in range(40)]
    consumer = made.consumer(broker, concurrency=4, max_batch=8)
    seen: dict[str, list[int]] = {key: [] for key in keys}
    lock = threading.Lock()

    def handle(message: Message) -> None:
        body = message.json()
        with lock:
            seen[body["key"]].append(body["n"])

    consumer.add_handler(SUBJECT, handle, ordered=True)
    with running(consumer), broker.client() as client:
        publish(broker, [(key, n) for n in range(5) for key in keys])
        client.split_partition(SUBJECT, partition=0, at=200)  # 0 -> 2, 3
        publish(broker, [(key, n) for n in range(5, 10) for key in keys])
        client.merge_partitions(SUBJECT, partitions=[2, 3])  # -> 4
        publish(broker, [(key, n) for n in range(10, 15) for key in keys])
        client.move_partition(SUBJECT, partition=1)  # -> 5
        publish(broker, [(key, n) for n in range(15, 20) for key in keys])
        wait_until(lambda: sum(map(len, seen.values())) == 20 * len(keys))
        wait_until(lambda: client.routes(SUBJECT)["groups"] == [{"group": GROUP, "version": 4}])
    assert seen == {key: list(range(20)) for key in keys}


def test_a_failure_nacks_the_rest_of_its_partitions_batch_in_one_request(made: Made) -> None:
    broker = declared(1)
    publish(broker, [("k", n) for n in range(5)])
    consumer = made.consumer(broker, concurrency=1, prefetch=4, max_batch=5)
    runs: list[tuple[int, int]] = []

    def fails_on_2(message: Message) -> None:
        n = message.json()["n"]
        runs.append((n, message.attempt))
        if n == 2 and message.attempt == 1:
            raise RetryLater(0, "not yet")

    consumer.add_handler(SUBJECT, fails_on_2, ordered=True)
    with running(consumer):
        wait_until(lambda: broker.acked_seqs(SUBJECT, GROUP, partition=0) == set(range(5)))
    assert runs == [(0, 1), (1, 1), (2, 1), (2, 2), (3, 1), (4, 1)]  # 3, 4 never ran
    (nack,) = broker.received("nack")
    assert (nack["seqs"], nack["partition"], nack["delay_ms"]) == ([2, 3, 4], 0, 0)
    assert nack["error"] == "RetryLater: not yet"
    stats = consumer.stats()
    assert (stats.processed, stats.nacked, stats.in_flight) == (5, 3, 0)


def test_partitions_run_side_by_side(made: Made) -> None:
    broker = declared(2)
    first, second = keys_by_partition(2)
    publish(broker, [(first, 0), (first, 1), (second, 0)])
    meeting = threading.Barrier(2, timeout=5)
    order: list[tuple[str, int]] = []

    def handler(message: Message) -> None:
        body = message.json()
        if body["n"] == 0:
            meeting.wait()  # both partitions' first messages run at the same time
        order.append((body["key"], body["n"]))

    consumer = made.consumer(broker, concurrency=2)
    consumer.add_handler(SUBJECT, handler, ordered=True)
    with running(consumer):
        wait_until(lambda: len(order) == 3)
    assert order.index((first, 0)) < order.index((first, 1))


def test_stop_finishes_the_running_message_and_returns_the_rest_at_once(made: Made) -> None:
    broker = declared(1, clock=StepClock())
    publish(broker, [("k", n) for n in range(4)])
    consumer = made.consumer(broker, concurrency=1, prefetch=3, max_batch=4)
    started = threading.Event()
    release = threading.Event()
    ran: list[int] = []

    def slow_second(message: Message) -> None:
        ran.append(message.seq)
        if message.seq == 1:  # the first of the second batch (a first pull asks for one)
            started.set()
            release.wait(5)

    consumer.add_handler(SUBJECT, slow_second, ordered=True)
    with running(consumer):
        assert started.wait(5)
        assert consumer.stats().pulled == 4
        stopper = threading.Thread(target=consumer.stop)
        stopper.start()
        stopper.join(5)  # stop() only asks; the handler is still running
        release.set()
    assert ran == [0, 1]
    assert broker.acked_seqs(SUBJECT, GROUP, partition=0) == {0, 1}
    (nack,) = broker.received("nack")
    assert (nack["seqs"], nack["partition"], nack["delay_ms"]) == ([2, 3], 0, 0)
    assert nack["error"] == "consumer stopped before handling"
    assert consumer.stats().in_flight == 0


def test_run_async_with_an_ordered_coroutine_handler(made: Made) -> None:
    broker = declared(4)
    keys = keys_by_partition(4)
    publish(broker, [(key, n) for n in range(10) for key in keys])
    consumer = made.consumer(broker, on_loop=True, concurrency=4)
    seen: dict[str, list[int]] = {key: [] for key in keys}

    @consumer.handler(SUBJECT, ordered=True)
    async def handle(message: Message) -> None:
        await asyncio.sleep(0)
        body = message.json()
        seen[body["key"]].append(body["n"])

    async def main() -> None:
        task = asyncio.create_task(consumer.run_async(install_signal_handlers=False))
        for _ in range(500):
            if consumer.stats().acked == 40:
                break
            await asyncio.sleep(0.01)
        consumer.stop()
        await task

    asyncio.run(main())
    assert seen == {key: list(range(10)) for key in keys}
    assert consumer.stats().acked == 40
    assert {a["partition"] for a in broker.received("ack")} == {0, 1, 2, 3}


def test_one_partitions_keys_run_side_by_side_while_one_key_waits(made: Made) -> None:
    """One partition, a handler of key "slow" that waits: every other key's messages are
    handled meanwhile, each key in order; the slow key's next one only after it."""
    broker = declared(1)
    keys = [f"key-{i}" for i in range(10)]
    publish(broker, [(key, n) for n in range(3) for key in ["slow", *keys]])
    released = threading.Event()
    seen: dict[str, list[int]] = {key: [] for key in ["slow", *keys]}
    lock = threading.Lock()

    def handle(message: Message) -> None:
        body = message.json()
        if body["key"] == "slow":
            assert released.wait(10)
        with lock:
            seen[body["key"]].append(body["n"])

    consumer = made.consumer(broker, concurrency=4)
    consumer.add_handler(SUBJECT, handle, ordered=True)
    with running(consumer):
        wait_until(lambda: all(seen[key] == [0, 1, 2] for key in keys))
        assert seen["slow"] == []
        released.set()
        wait_until(lambda: seen["slow"] == [0, 1, 2])
    assert {p["max_keys"] for p in broker.received("pull")} == {8}  # 2 x concurrency


def test_ordered_keys_is_sent_as_max_keys_and_checked(made: Made) -> None:
    broker = declared(1)
    publish(broker, [("a", 0), ("b", 0)])
    consumer = made.consumer(broker, concurrency=4, ordered_keys=1)
    seen: list[str] = []
    consumer.add_handler(SUBJECT, lambda m: seen.append(m.json()["key"]), ordered=True)
    with running(consumer):
        wait_until(lambda: sorted(seen) == ["a", "b"])
    assert {p["max_keys"] for p in broker.received("pull")} == {1}
    for bad in (0, 1025):
        with pytest.raises(ConfigurationError, match="ordered_keys"):
            Consumer("http://unused", GROUP, ordered_keys=bad)
