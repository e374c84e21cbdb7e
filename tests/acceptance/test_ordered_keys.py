"""Per-key concurrency in an ordered subject on real broker processes (issue 39): one slow
or failing key holds back its own messages only.

One subject with one partition and 200 keys, consumed by the SDK's ordered handler
(``@consumer.handler(subject, ordered=True)``, in this process) as a user would run it.
Each key's messages carry their number n; per key, the first handling of each message
must read 0, 1, 2, ... (a redelivery after a lost ack is skipped, as an idempotent store
would), and the reconciliation's acked-order check (``tests/support/acked_order.py``) must
find nothing in the broker's files afterwards.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from qmq_outbox import BrokerClient, Consumer, Message, OutgoingMessage, RetryLater
from tests.integration.consumer_support import running, wait_for
from tests.support.acked_order import acked_out_of_order
from tests.support.broker_process import BrokerProcess

pytestmark = pytest.mark.timeout(300)

SUBJECT = "orders.keyed"
GROUP = "billing"
KEYS = [f"customer-{n:03d}" for n in range(200)]
POISON = KEYS[7]
FAILURES = 3  # the poison key's first message fails this often, then succeeds
RETRY_S = 2.0


class Ledger:
    """What the handlers did: per key the numbers handled (first handling of each id),
    and when each was handled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handled: dict[str, list[int]] = defaultdict(list)
        self.at: dict[tuple[str, int], float] = {}
        self.ids: set[str] = set()
        self.running: set[str] = set()
        self.overlaps: list[str] = []  # a key run twice at once

    def enter(self, message: Message) -> None:
        with self.lock:
            if message.key in self.running:
                self.overlaps.append(str(message.key))
            self.running.add(str(message.key))

    def leave(self, message: Message) -> None:
        with self.lock:
            self.running.discard(str(message.key))

    def record(self, message: Message) -> None:
        body = message.json()
        with self.lock:
            if message.id in self.ids:
                return  # handled before, its ack lost to a crash
            self.ids.add(message.id)
            self.handled[body["key"]].append(body["n"])
            self.at[(body["key"], body["n"])] = time.monotonic()

    def count(self) -> int:
        with self.lock:
            return len(self.ids)


def publish(client: BrokerClient, numbers: range) -> set[int | None]:
    """Every key's messages ``numbers``, interleaved across keys, in order per key; the
    partitions they went to."""
    messages = [
        OutgoingMessage(
            id=f"{key}/{n}", subject=SUBJECT, key=key, body=orjson.dumps({"key": key, "n": n})
        )
        for n in numbers
        for key in KEYS
    ]
    partitions: set[int | None] = set()
    for start in range(0, len(messages), 500):
        results = client.produce(messages[start : start + 500])
        assert {r.status for r in results} == {"stored"}
        partitions.update(r.partition for r in results)
    return partitions


def consumer(url: str, ledger: Ledger, fails: Any) -> Consumer:
    """The SDK's consumer with an ordered handler that fails while ``fails(message)``."""
    made = Consumer(
        url,
        GROUP,
        consumer_id="c1",
        concurrency=8,
        wait_ms=200,
        ack_interval=0.02,
        shutdown_timeout=10,
    )

    @made.handler(SUBJECT, ordered=True)
    def handle(message: Message) -> None:
        ledger.enter(message)
        try:
            if fails(message):
                raise RetryLater(RETRY_S, "poison")
            time.sleep(0.001)
            ledger.record(message)
        finally:
            ledger.leave(message)

    return made


def first_failures(message: Message) -> bool:
    return message.key == POISON and message.json()["n"] == 0 and message.attempt <= FAILURES


def assert_in_order(ledger: Ledger, per_key: int) -> None:
    wrong = {k: ns for k in KEYS if (ns := ledger.handled[k]) != list(range(per_key))}
    assert not wrong, dict(list(wrong.items())[:5])
    assert ledger.overlaps == []


def assert_acked_in_order(broker: BrokerProcess, judged: int) -> None:
    broker.stop()
    found, counted = acked_out_of_order(broker.data_dir)
    assert found == []
    assert counted == judged


def start(tmp_path: Path, *flags: str) -> BrokerProcess:
    args = ["--ack-timeout", "5s", "--partition-lease", "2s", "--max-attempts", "10", *flags]
    return BrokerProcess(tmp_path / "data", extra_args=args).start()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start(tmp_path)
    yield process
    process.stop()


def test_a_retrying_key_holds_back_its_own_messages_only(broker: BrokerProcess) -> None:
    ledger = Ledger()
    with BrokerClient(broker.url) as client:
        client.declare_subject(SUBJECT, partitions=1)
        assert publish(client, range(5)) == {0}
        with running(consumer(broker.url, ledger, first_failures)):
            wait_for(lambda: ledger.count() == 1000, timeout=60, what="1000 handled")
        stats = client.subject(SUBJECT)["groups"][0]
    assert_in_order(ledger, 5)
    others = max(at for (key, _), at in ledger.at.items() if key != POISON)
    assert others < ledger.at[(POISON, 0)]  # everyone else was done while it retried
    assert ledger.at[(POISON, 0)] - min(ledger.at.values()) > FAILURES * RETRY_S * 0.9
    assert (stats["acked"], stats["backlog"], stats["retrying"], stats["dead"]) == (1000, 0, 0, 0)
    assert_acked_in_order(broker, 1000)


def test_a_dead_key_blocks_its_own_messages_only_until_redriven(tmp_path: Path) -> None:
    broker = start(tmp_path, "--max-attempts", "3")
    fixed = threading.Event()
    ledger = Ledger()

    def until_fixed(message: Message) -> bool:
        return message.key == POISON and not fixed.is_set()

    try:
        with BrokerClient(broker.url) as client:
            client.declare_subject(SUBJECT, partitions=1, on_dead="block")
            publish(client, range(5))
            with running(consumer(broker.url, ledger, until_fixed)):
                wait_for(lambda: ledger.count() == 995, timeout=60, what="the other keys")
                dead = wait_for(
                    lambda: client.dead_letters(SUBJECT, GROUP, partition=0)["dead"],
                    timeout=30,
                    what="the poison key's dead letter",
                )
                assert [(d["message"]["key"], d["attempts"]) for d in dead] == [(POISON, 3)]
                time.sleep(1.0)  # the dead key's later messages stay where they are
                assert ledger.handled[POISON] == []
                stats = client.subject(SUBJECT)["groups"][0]
                assert (stats["dead"], stats["acked"], stats["in_flight"]) == (1, 995, 0)
                # the key's later messages wait: released behind the failure, or passed over
                assert stats["retrying"] + stats["backlog"] == 4
                fixed.set()
                assert client.redrive(SUBJECT, GROUP, partition=0) == 1
                wait_for(lambda: ledger.count() == 1000, timeout=30, what="the redriven key")
        assert_in_order(ledger, 5)
        assert_acked_in_order(broker, 999)  # the redriven one was dead once: left out
    finally:
        broker.stop()


def test_kill9_of_the_broker_changes_nothing(tmp_path: Path) -> None:
    """20 cycles (about 50 s): each stores one more message per key, lets the consumer run
    a little (the poison key retrying all along), then kills the broker with SIGKILL and
    restarts it; checkpoints every second, so restarts begin from ones that hold
    passed-over seqs."""
    broker = start(tmp_path, "--checkpoint-interval", "1s")
    try:
        kill9_cycles(broker, 20)
    finally:
        broker.stop()


def kill9_cycles(broker: BrokerProcess, cycles: int) -> None:
    ledger = Ledger()
    rng = random.Random(39)
    with BrokerClient(broker.url) as client:
        client.declare_subject(SUBJECT, partitions=1)
    with running(consumer(broker.url, ledger, first_failures)):
        for cycle in range(cycles):
            with BrokerClient(broker.url) as client:
                publish(client, range(cycle, cycle + 1))
            time.sleep(rng.uniform(0.2, 0.6))
            broker.kill9()
            time.sleep(rng.uniform(0.0, 0.3))
            broker.restart()
        total = len(KEYS) * cycles
        wait_for(lambda: ledger.count() == total, timeout=120, what=f"{total} handled")
    assert_in_order(ledger, cycles)
    with BrokerClient(broker.url) as client:
        stats = client.subject(SUBJECT)["groups"][0]
    assert (stats["backlog"], stats["in_flight"], stats["retrying"]) == (0, 0, 0)
    assert_acked_in_order(broker, total)


def test_split_and_merge_while_keys_are_in_flight_keep_every_keys_order(
    broker: BrokerProcess,
) -> None:
    """The poison key is retrying (and others in flight) when the partition is split, and
    again when the two halves are merged: every key still reads 0, 1, 2, ..."""
    ledger = Ledger()

    def each_rounds_first(message: Message) -> bool:
        return message.key == POISON and message.json()["n"] in (0, 3) and message.attempt == 1

    with BrokerClient(broker.url) as client:
        client.declare_subject(SUBJECT, partitions=1)
        with running(consumer(broker.url, ledger, each_rounds_first)):
            assert publish(client, range(3)) == {0}
            wait_for(lambda: len(ledger.handled) > 20, timeout=30, what="keys under way")
            split = client.split_partition(SUBJECT, partition=0, at=512)
            halves = sorted(r["partition"] for r in split["ranges"])
            assert publish(client, range(3, 6)) == set(halves)
            wait_for(lambda: ledger.count() > 1000, timeout=60, what="the split's keys")
            merged = client.merge_partitions(SUBJECT, partitions=halves)
            assert publish(client, range(6, 9)) == {r["partition"] for r in merged["ranges"]}
            wait_for(lambda: ledger.count() == 1800, timeout=60, what="1800 handled")
            routes = client.routes(SUBJECT)
    assert_in_order(ledger, 9)
    assert routes["version"] == 3
    assert routes["groups"] == [{"group": GROUP, "version": 3}]
    assert_acked_in_order(broker, 1800)
