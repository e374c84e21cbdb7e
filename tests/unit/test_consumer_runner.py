"""The consumer's runners against the in-memory broker: acks, nacks, prefetch, stopping.

The consumer talks to ``InMemoryBroker`` through the real clients (``httpx.MockTransport``,
no sockets); the tests read what reached the broker from its test controls.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from qmq_outbox import Consumer, Message, OutgoingMessage, RetryLater
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.consumer import ConsumerCrashed
from qmq_outbox.errors import BrokerRejected
from qmq_outbox.testing import InMemoryBroker, StepClock
from tests.support.waiting import wait_until, wait_until_async

SUBJECT = "order.created"
RETRY_AT_ONCE = (0.0,)  # the broker's backoff after a plain nack: none, so tests need not wait


class Consumers:
    """Consumers wired to an ``InMemoryBroker`` through the real clients; the clients are
    closed after the test (a consumer does not close an injected client)."""

    def __init__(self) -> None:
        self._clients: list[BrokerClient | AsyncBrokerClient] = []

    def make(self, broker: InMemoryBroker, *, on_loop: bool = False, **kwargs: object) -> Consumer:
        """A consumer ``c1`` of group ``g``; ``on_loop``: with an ``AsyncBrokerClient``, for
        ``run_async()``."""
        client = broker.async_client() if on_loop else broker.client()
        self._clients.append(client)
        settings: dict[str, object] = {
            "consumer_id": "c1",
            "wait_ms": 50,
            "ack_interval": 0.02,
            "shutdown_timeout": 5.0,
        }
        settings.update(kwargs)
        return Consumer("http://unused", "g", client=client, **settings)  # type: ignore[arg-type]

    def close(self) -> None:
        for client in self._clients:
            if isinstance(client, AsyncBrokerClient):
                asyncio.run(client.aclose())
            else:
                client.close()


@pytest.fixture
def consumers() -> Iterator[Consumers]:
    made = Consumers()
    yield made
    made.close()


def produce(
    broker: InMemoryBroker, subject: str, count: int = 1, *, ids: Sequence[str] = ()
) -> None:
    """Store ``count`` messages (ids ``<subject>-<n>``, or ``ids``) through the real client."""
    names = ids or [f"{subject}-{n}" for n in range(count)]
    with broker.client() as client:
        client.produce([OutgoingMessage(id=name, subject=subject, body=b"{}") for name in names])


@contextmanager
def running(consumer: Consumer) -> Iterator[threading.Thread]:
    """``consumer.run()`` on a thread (no signal handlers there); stopped and joined after."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            consumer.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="test-consumer-run")
    thread.start()
    try:
        yield thread
    finally:
        consumer.stop()
        thread.join(10)
        assert not thread.is_alive()
    if errors:
        raise errors[0]


def test_returned_handlers_are_acked_in_batches(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 50)
    # Only full batches and one last flush may send acks: room to lease all 50 (a puller
    # short of lease slots would hurry the acker), no interval flush, and a long poll that
    # comes back empty (and hurries the acker) only well after the handlers are done.
    consumer = consumers.make(
        broker, ack_batch_size=10, ack_interval=60.0, prefetch=50, wait_ms=500
    )
    handled: list[int] = []
    consumer.add_handler(SUBJECT, lambda m: handled.append(m.seq))
    with running(consumer):
        wait_until(lambda: len(broker.acked_seqs(SUBJECT, "g")) == 50)
    assert sorted(handled) == list(range(50))
    # sent on their own, or carried by the subject's next pull
    acks = [a["seqs"] for a in broker.received("ack")]
    acks += [p["ack"] for p in broker.received("pull") if "ack" in p]
    assert len(acks) <= 6, "acks must be batched, not one request per message"
    assert sorted(seq for ack in acks for seq in ack) == list(range(50))
    assert consumer.stats().acked == 50
    assert consumer.stats().processed == 50
    assert consumer.stats().in_flight == 0


def test_a_busy_subject_carries_its_acks_on_the_next_pull(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 300)
    # Acks never go out by size or interval here: the pulls carry them while the backlog
    # lasts, and the acker sends what is left once a pull comes back empty.
    consumer = consumers.make(
        broker, ack_batch_size=10_000, ack_interval=60.0, prefetch=48, max_batch=16
    )
    consumer.add_handler(SUBJECT, lambda m: None)
    with running(consumer):
        wait_until(lambda: len(broker.acked_seqs(SUBJECT, "g")) == 300)
        wait_until(lambda: consumer.stats().acked == 300)
    carried = [seq for pull in broker.received("pull") for seq in pull.get("ack", [])]
    sent = [seq for ack in broker.received("ack") for seq in ack["seqs"]]
    # most ride on pulls (185-250 of 300 in 25 runs, with the threads' timing); without
    # carrying none would
    assert len(carried) >= 150, "a busy subject's acks ride on its pulls"
    assert sorted(carried + sent) == list(range(300))  # each acked once
    # the acker still sends when a puller is short of slots and has nothing to carry yet,
    # a few times (2-9 in 30 quiet runs, 11 beside other tests), not once per message
    assert len(broker.received("ack")) <= 20
    assert consumer.stats().ack_unknown == 0
    assert consumer.stats().in_flight == 0


def test_acks_waiting_for_the_interval_are_flushed_on_stop(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT)
    consumer = consumers.make(broker, ack_batch_size=1000, ack_interval=60.0)
    consumer.add_handler(SUBJECT, lambda m: None)
    with running(consumer):
        wait_until(lambda: consumer.stats().processed == 1)
        assert broker.acked_seqs(SUBJECT, "g") == set()
    assert broker.acked_seqs(SUBJECT, "g") == {0}


def test_an_exception_nacks_and_the_message_comes_back_with_the_next_attempt(
    consumers: Consumers,
) -> None:
    broker = InMemoryBroker(max_attempts=3, backoff=RETRY_AT_ONCE)
    produce(broker, SUBJECT)
    consumer = consumers.make(broker)
    attempts: list[int] = []

    def always_fails(message: Message) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("downstream is down")

    consumer.add_handler(SUBJECT, always_fails)
    with running(consumer):
        wait_until(lambda: broker.dead_seqs(SUBJECT, "g") == {0})
    assert attempts == [1, 2, 3]
    nacks = broker.received("nack")
    assert [n["delay_ms"] for n in nacks] == [None, None, None]
    assert nacks[0]["error"] == "RuntimeError: downstream is down"


def test_retry_later_sets_the_nack_delay(consumers: Consumers) -> None:
    clock = StepClock()
    broker = InMemoryBroker(clock=clock)
    produce(broker, SUBJECT)
    consumer = consumers.make(broker)
    seen: list[int] = []

    def once_later(message: Message) -> None:
        seen.append(message.attempt)
        if message.attempt == 1:
            raise RetryLater(0.75, "not yet")

    consumer.add_handler(SUBJECT, once_later)
    with running(consumer):
        wait_until(lambda: broker.received("nack"))
        clock.advance(0.75)  # the retry is due
        wait_until(lambda: broker.acked_seqs(SUBJECT, "g") == {0})
    assert seen == [1, 2]
    assert broker.received("nack")[0]["delay_ms"] == 750


def test_a_slow_handler_holds_at_most_concurrency_plus_prefetch_leases(
    consumers: Consumers,
) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 40)
    release = threading.Event()
    consumer = consumers.make(broker, concurrency=2, prefetch=3, max_batch=32)
    consumer.add_handler(SUBJECT, lambda m: release.wait(10))
    with running(consumer):
        wait_until(lambda: broker.most_leased("g", "c1") >= 5)
        time.sleep(0.2)  # give a hoarding consumer the chance to pull more (it must not)
        assert broker.most_leased("g", "c1") == 5
        assert consumer.stats().in_flight == 5
        release.set()
        wait_until(lambda: len(broker.acked_seqs(SUBJECT, "g")) == 40)
    assert broker.most_leased("g", "c1") == 5
    assert max(pull["max"] for pull in broker.received("pull")) <= 5


def test_an_idle_subject_does_not_starve_a_busy_one(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, "busy", 30)
    consumer = consumers.make(broker, concurrency=1, prefetch=1, wait_ms=2000)
    consumer.add_handler("busy", lambda m: None)
    consumer.add_handler("idle", lambda m: None)
    with running(consumer):
        wait_until(lambda: len(broker.acked_seqs("busy", "g")) == 30, timeout=3.0)


def test_several_subjects_each_reach_their_handler(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, "a")
    produce(broker, "b")
    consumer = consumers.make(broker)
    seen: list[str] = []
    consumer.add_handler("a", lambda m: seen.append(m.subject))
    consumer.add_handler("b", lambda m: seen.append(m.subject))
    with running(consumer):
        wait_until(lambda: len(seen) == 2)
    assert sorted(seen) == ["a", "b"]


def test_stop_finishes_in_flight_handlers_and_acks_them(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 4)
    started = threading.Barrier(5)
    consumer = consumers.make(broker, concurrency=4, prefetch=0, ack_interval=60.0)

    def slow(message: Message) -> None:
        started.wait(5)
        time.sleep(0.2)

    consumer.add_handler(SUBJECT, slow)
    with running(consumer):
        started.wait(5)  # all four handlers are running
        consumer.stop()
    assert broker.acked_seqs(SUBJECT, "g") == {0, 1, 2, 3}


def test_at_the_stop_timeout_unstarted_messages_are_released_at_once(
    consumers: Consumers,
) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 3)
    gate = threading.Event()
    consumer = consumers.make(broker, concurrency=1, prefetch=2, shutdown_timeout=0.3)
    consumer.add_handler(SUBJECT, lambda m: gate.wait(10))
    try:
        with running(consumer):
            wait_until(lambda: consumer.stats().pulled == 3)
    finally:
        gate.set()
    nacks = broker.received("nack")
    assert sorted(seq for n in nacks for seq in n["seqs"]) == [1, 2]
    assert all(n["delay_ms"] == 0 for n in nacks)


def test_pull_failures_are_retried(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    broker.fail("pull", code="recovering", times=3)  # 503: the client raises BrokerUnavailable
    produce(broker, SUBJECT)
    consumer = consumers.make(broker)
    consumer.add_handler(SUBJECT, lambda m: None)
    with running(consumer):
        wait_until(lambda: broker.acked_seqs(SUBJECT, "g") == {0})
    assert len(broker.received("pull")) >= 4


def test_a_dead_loop_takes_the_consumer_down_loudly(
    consumers: Consumers, caplog: pytest.LogCaptureFixture
) -> None:
    broker = InMemoryBroker()
    broker.fail("pull", code="forbidden", times=None)  # 403: the client raises BrokerRejected
    consumer = consumers.make(broker)
    consumer.add_handler(SUBJECT, lambda m: None)
    with pytest.raises(ConsumerCrashed) as crashed:
        consumer.run(install_signal_handlers=False)
    assert isinstance(crashed.value.__cause__, BrokerRejected)
    assert crashed.value.__cause__.code == "forbidden"
    died = [r for r in caplog.records if getattr(r, "action", None) == "consumer.loop_died"]
    assert died
    assert died[0].loop == f"pull-{SUBJECT}"  # type: ignore[attr-defined]


def test_handler_threads_are_named(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT)
    consumer = consumers.make(broker, concurrency=2)
    threads: list[str] = []
    consumer.add_handler(SUBJECT, lambda m: threads.append(threading.current_thread().name))
    with running(consumer):
        wait_until(lambda: consumer.stats().processed == 1)
        names = {t.name for t in threading.enumerate()}
    assert threads[0] in {"qmq-consumer[g]-worker-0", "qmq-consumer[g]-worker-1"}
    assert {"qmq-consumer[g]-worker-0", "qmq-consumer[g]-worker-1"} <= names


async def test_loops_are_named_tasks(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    consumer = consumers.make(broker, on_loop=True, concurrency=2)
    consumer.add_handler(SUBJECT, lambda m: None)
    names: set[str] = set()

    def seen() -> bool:
        names.update(task.get_name() for task in asyncio.all_tasks())
        return f"qmq-consumer[g]-pull-{SUBJECT}" in names

    await _run_until(consumer, seen)
    assert {"qmq-consumer[g]-acks", "qmq-consumer[g]-worker-0", "qmq-consumer[g]-worker-1"} <= names


def test_sigterm_in_the_main_thread_stops_run_gracefully(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 3)
    consumer = consumers.make(broker, ack_interval=60.0)
    consumer.add_handler(SUBJECT, lambda m: None)
    previous = signal.getsignal(signal.SIGTERM)

    def send_sigterm() -> None:
        wait_until(lambda: consumer.stats().processed == 3)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=send_sigterm)
    killer.start()
    consumer.run()  # returns instead of dying: SIGTERM means stop gracefully
    killer.join()
    assert broker.acked_seqs(SUBJECT, "g") == {0, 1, 2}
    assert signal.getsignal(signal.SIGTERM) is previous


# -- asyncio -----------------------------------------------------------------------------


async def _run_until(consumer: Consumer, done: Callable[[], bool]) -> None:
    task = asyncio.create_task(consumer.run_async(install_signal_handlers=False))
    try:
        await wait_until_async(done)
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 10)


async def test_async_consumer_acks_nacks_and_bounds_prefetch(consumers: Consumers) -> None:
    broker = InMemoryBroker(max_attempts=2, backoff=RETRY_AT_ONCE)
    produce(broker, SUBJECT, 20)
    produce(broker, "poison")
    consumer = consumers.make(broker, on_loop=True, concurrency=3, prefetch=1, ack_batch_size=5)
    handled: list[int] = []

    async def on_message(message: Message) -> None:
        await asyncio.sleep(0.005)
        handled.append(message.seq)

    async def poison(message: Message) -> None:
        raise ValueError("bad payload")

    consumer.add_handler(SUBJECT, on_message)
    consumer.add_handler("poison", poison)
    await _run_until(
        consumer,
        lambda: (
            len(broker.acked_seqs(SUBJECT, "g")) == 20 and broker.dead_seqs("poison", "g") == {0}
        ),
    )
    assert sorted(handled) == list(range(20))
    assert broker.most_leased("g", "c1") <= 4
    assert consumer.stats().nacked == 2


async def test_async_consumer_runs_plain_handlers_and_flushes_on_stop(
    consumers: Consumers,
) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT)
    consumer = consumers.make(broker, on_loop=True, ack_interval=60.0)
    threads: list[str] = []
    consumer.add_handler(SUBJECT, lambda m: threads.append(threading.current_thread().name))
    await _run_until(consumer, lambda: consumer.stats().processed == 1)
    assert broker.acked_seqs(SUBJECT, "g") == {0}
    assert len(threads) == 1
    assert threads[0] != threading.main_thread().name


async def test_async_consumer_dies_loudly(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    broker.fail("pull", code="unauthorized", times=None)  # 401: BrokerRejected
    consumer = consumers.make(broker, on_loop=True)
    consumer.add_handler(SUBJECT, lambda m: None)
    with pytest.raises(ConsumerCrashed):
        await asyncio.wait_for(consumer.run_async(install_signal_handlers=False), 10)


async def test_async_stop_timeout_cancels_and_releases(consumers: Consumers) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 3)
    consumer = consumers.make(broker, on_loop=True, concurrency=1, prefetch=2, shutdown_timeout=0.2)

    async def stuck(message: Message) -> None:
        await asyncio.sleep(30)

    consumer.add_handler(SUBJECT, stuck)
    await _run_until(consumer, lambda: consumer.stats().pulled == 3)
    nacks = broker.received("nack")
    assert sorted(seq for n in nacks for seq in n["seqs"]) == [1, 2]


def test_run_async_refuses_a_sync_client(consumers: Consumers) -> None:
    consumer = consumers.make(InMemoryBroker())
    consumer.add_handler(SUBJECT, lambda m: None)
    from qmq_outbox.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="AsyncBrokerClient"):
        asyncio.run(consumer.run_async())


def test_batched_acks_do_not_stall_a_consumer_whose_budget_is_spent(
    consumers: Consumers,
) -> None:
    broker = InMemoryBroker()
    produce(broker, SUBJECT, 60)
    consumer = consumers.make(broker, concurrency=2, prefetch=1, ack_interval=60.0)
    consumer.add_handler(SUBJECT, lambda m: None)
    with running(consumer):
        wait_until(lambda: len(broker.acked_seqs(SUBJECT, "g")) == 60, timeout=3.0)
    assert broker.most_leased("g", "c1") <= 3


@pytest.mark.parametrize("runner", ["threads", "asyncio"])
def test_a_batching_store_acks_the_good_and_nacks_the_bad(
    consumers: Consumers, tmp_path: Path, runner: str
) -> None:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session, sessionmaker

    from qmq_outbox import IdempotentStore
    from qmq_outbox.schema import metadata

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'batch.db'}")
    metadata.create_all(engine)
    broker = InMemoryBroker(max_attempts=1)
    produce(broker, SUBJECT, ids=["poison" if index == 17 else f"m-{index}" for index in range(40)])
    store = IdempotentStore(sessionmaker(engine), batch_size=8)
    handled: list[str] = []

    def bill(message: Message, session: Session) -> None:
        if message.id == "poison":
            raise ValueError("poison")
        handled.append(message.id)

    def done() -> bool:
        return len(broker.acked_seqs(SUBJECT, "g")) == 39 and broker.dead_seqs(SUBJECT, "g") == {17}

    if runner == "threads":
        consumer = consumers.make(broker, concurrency=1, prefetch=15)
        consumer.add_handler(SUBJECT, bill, idempotent=store)
        with running(consumer):
            wait_until(done)
    else:
        consumer = consumers.make(broker, on_loop=True, concurrency=1, prefetch=15)
        consumer.add_handler(SUBJECT, bill, idempotent=store)
        asyncio.run(_run_until(consumer, done))
    assert len(set(handled)) == 39
    assert consumer.stats().processed == 39
    engine.dispose()
