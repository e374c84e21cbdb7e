"""The scheduler inside a real ``Broker`` (files in tmp_path, no HTTP): threads and isolation."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import qmq_broker.pulls.reads
import qmq_broker.pulls.service
from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.engine import Broker
from qmq_broker.messages import IncomingMessage
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.pulls import MailboxFull
from qmq_broker.storage.segments import NotCached
from tests.unit.page_cache import evict


def message(i: int, subject: str) -> IncomingMessage:
    return IncomingMessage(
        id=f"{subject}-{i}",
        subject=subject,
        key=None,
        headers={},
        body=b"x" * 100,
        body_base64=False,
        producer=None,
        created_at_us=None,
        deliver_at_us=0,
    )


@pytest.fixture
def readahead_wait_s() -> float:
    return BrokerConfig(data_dir=Path(".")).readahead_wait_s


@pytest.fixture
async def running(tmp_path: Path, readahead_wait_s: float) -> AsyncIterator[Broker]:
    config = BrokerConfig(
        data_dir=tmp_path,
        fsync=FsyncPolicy(mode="never"),
        mailbox_size=3,
        debug_read_delay_s=(("orders", "cold", 1.0),),
        readahead_wait_s=readahead_wait_s,
    )
    instance = Broker(config, metrics=BrokerMetrics())
    await instance.start()
    try:
        await instance.services.producer.produce([message(i, "orders") for i in range(50)])
        yield instance
    finally:
        await instance.close()


async def pull(instance: Broker, group: str, *, wait_ms: int = 0, consumer: str = "c") -> Any:
    messages, _ = await instance.services.delivery.ack_and_pull(
        ack=None,
        subject="orders",
        group=group,
        consumer=consumer,
        max_messages=5,
        wait_ms=wait_ms,
        mode="shared",
        start="earliest",
    )
    return messages


def spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads that read a batch (a cached-only attempt that gave up is not counted)."""
    threads: list[str] = []
    read = qmq_broker.pulls.reads._read_batch

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = read(*args, **kwargs)
        threads.append(threading.current_thread().name)
        return result

    monkeypatch.setattr(qmq_broker.pulls.reads, "_read_batch", spy)
    return threads


async def test_records_in_the_page_cache_are_read_on_the_loop(
    running: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = spy_reads(monkeypatch)
    got = await pull(running, "g")
    assert [m["seq"] for m in got] == [0, 1, 2, 3, 4]
    assert threads == [threading.current_thread().name]


def spy_read_aheads(monkeypatch: pytest.MonkeyPatch, *, arrive: bool = True) -> list[int]:
    """How many batches each read-ahead asked for. The first look in the cache misses, as
    it does for evicted records on a disk slower than the loop (a virtual disk backed by
    the host's cache can fill the pages within the look, and then it finds them); later
    looks read the cache. ``arrive`` False: a disk that never delivers (every look misses,
    whatever the kernel reads)."""
    asked: list[int] = []
    looks: list[int] = []
    read_ahead = qmq_broker.pulls.service.read_ahead
    read_cached = qmq_broker.pulls.service.read_cached

    def spy(reader: Any, batches: list[Any]) -> None:
        asked.append(len(batches))
        read_ahead(reader, batches)

    def first_misses(reader: Any, batches: list[Any]) -> Any:
        looks.append(1)
        if len(looks) == 1 or not arrive:
            raise NotCached
        return read_cached(reader, batches)

    monkeypatch.setattr(qmq_broker.pulls.service, "read_ahead", spy)
    monkeypatch.setattr(qmq_broker.pulls.service, "read_cached", first_misses)
    return asked


async def pull_evicted(
    instance: Broker, data_dir: Path, monkeypatch: pytest.MonkeyPatch, *, arrive: bool = True
) -> tuple[list[int], list[str], list[int], float]:
    """A pull of records evicted from the page cache: the seqs it got, the threads that read
    them, the read-aheads asked for, and how long it took."""
    evict(data_dir)
    asked = spy_read_aheads(monkeypatch, arrive=arrive)
    threads = spy_reads(monkeypatch)
    began = time.monotonic()
    got = await pull(instance, "g")
    return [m["seq"] for m in got], threads, asked, time.monotonic() - began


def read_on_the_pool(threads: list[str]) -> bool:
    return bool(threads) and all(name.startswith("qmq-pull-read") for name in threads)


# a generous wait: a busy test machine's disk must not turn this into the thread fallback
@pytest.mark.parametrize("readahead_wait_s", [5.0])
async def test_records_not_in_the_page_cache_are_read_ahead_then_read_on_the_loop(
    running: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs, threads, asked, _ = await pull_evicted(running, tmp_path, monkeypatch)
    assert seqs == [0, 1, 2, 3, 4]
    assert asked == [1]  # they were not in the cache: the kernel was asked for them
    assert threads == [threading.current_thread().name]


async def test_records_that_do_not_arrive_in_time_are_read_on_the_read_pool(
    running: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs, threads, asked, took = await pull_evicted(running, tmp_path, monkeypatch, arrive=False)
    assert seqs == [0, 1, 2, 3, 4]
    assert asked == [1]
    assert took >= running.config.readahead_wait_s
    assert read_on_the_pool(threads), threads


@pytest.mark.parametrize("readahead_wait_s", [0.0])
async def test_with_no_readahead_wait_records_on_disk_go_to_the_read_pool_at_once(
    running: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs, threads, asked, _ = await pull_evicted(running, tmp_path, monkeypatch)
    assert seqs == [0, 1, 2, 3, 4]
    assert asked == []
    assert read_on_the_pool(threads), threads


async def test_a_slow_read_delays_only_its_own_group(running: Broker) -> None:
    cold = asyncio.create_task(pull(running, "cold"))  # its read sleeps 1 s on a thread
    await asyncio.sleep(0.05)
    began = time.monotonic()
    hot = await pull(running, "hot")
    assert time.monotonic() - began < 0.5
    assert len(hot) == 5
    assert not cold.done()
    assert len(await cold) == 5


async def test_a_long_poll_is_resumed_by_a_produce(running: Broker) -> None:
    await pull(running, "g")  # the group exists and is at seq 5
    for _ in range(9):
        await pull(running, "g")
    waiting = asyncio.create_task(pull(running, "g", wait_ms=10_000))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    began = time.monotonic()
    await running.services.producer.produce([message(100, "orders")])
    got = await asyncio.wait_for(waiting, timeout=5)
    assert time.monotonic() - began < 0.5  # woken by the produce, not by its 10 s timeout
    assert [m["id"] for m in got] == ["orders-100"]


async def test_the_mailbox_bound_covers_parked_long_polls(running: Broker) -> None:
    for _ in range(10):
        await pull(running, "g")  # drain the 50 messages
    polls = [asyncio.create_task(pull(running, "g", wait_ms=5_000)) for _ in range(3)]
    await asyncio.sleep(0.05)
    with pytest.raises(MailboxFull):
        await pull(running, "g")
    running.begin_shutdown()  # answers every parked long poll now
    assert await asyncio.wait_for(asyncio.gather(*polls), timeout=5) == [[], [], []]
