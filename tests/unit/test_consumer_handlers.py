"""Handler registration rules and what a handler's return or exception comes to."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message, RetryLater
from qmq_outbox.consumer.handlers import Ack, HandlerSpec, Nack, handle, handle_async
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.idempotent import ClaimHeld
from tests.support.messages import delivered


def _msg(seq: int = 0) -> Message:
    return delivered("orders", seq, f"m-{seq}", b'{"n": 1}', 1)


@pytest.fixture
def sync_store(tmp_path: Path) -> IdempotentStore[Session]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'h.db'}")
    return IdempotentStore(sessionmaker(engine))


@pytest.fixture
def async_store(tmp_path: Path) -> IdempotentStore[AsyncSession]:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'h.db'}")
    return IdempotentStore(async_sessionmaker(engine))


def test_a_handler_is_registered_and_returned_unchanged() -> None:
    consumer = Consumer("http://unused", "billing")

    @consumer.handler("order.created")
    def on_created(message: Message) -> None:
        pass

    @consumer.handler("order.paid")
    def on_paid(message: Message) -> None:
        pass

    assert on_created.__name__ == "on_created"
    assert consumer.subjects == ["order.created", "order.paid"]
    assert consumer.consumer_id  # generated


@pytest.mark.parametrize("subject", ["", "_qmq.internal", "bad subject", "-x", "x" * 201])
def test_bad_subjects_are_refused(subject: str) -> None:
    consumer = Consumer("http://unused", "g")
    with pytest.raises(ConfigurationError, match="invalid subject"):
        consumer.add_handler(subject, lambda m: None)


def test_one_handler_per_subject() -> None:
    consumer = Consumer("http://unused", "g")
    consumer.add_handler("a", lambda m: None)
    with pytest.raises(ConfigurationError, match="already has a handler"):
        consumer.add_handler("a", lambda m: None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"concurrency": 0},
        {"max_batch": 1001},
        {"wait_ms": -1},
        {"mode": "fanout"},
        {"start": "middle"},
        {"ack_batch_size": 0},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Consumer("http://unused", "g", **kwargs)  # type: ignore[arg-type]


def test_store_and_handler_must_both_be_sync_or_async(
    sync_store: IdempotentStore[Session], async_store: IdempotentStore[AsyncSession]
) -> None:
    consumer = Consumer("http://unused", "g")

    async def coroutine(message: Message, session: object) -> None:
        pass

    def plain(message: Message, session: object) -> None:
        pass

    with pytest.raises(ConfigurationError, match="async"):
        consumer.add_handler("a", coroutine, idempotent=sync_store)
    with pytest.raises(ConfigurationError, match="async"):
        consumer.add_handler("b", plain, idempotent=async_store)
    with pytest.raises(ConfigurationError, match="plain"):
        consumer.add_handler("c", coroutine, idempotent=sync_store.non_transactional())
    consumer.add_handler("d", plain, idempotent=async_store.non_transactional())
    with pytest.raises(ConfigurationError, match="IdempotentStore"):
        consumer.add_handler("e", plain, idempotent=object())  # type: ignore[arg-type]


def test_run_refuses_async_handlers() -> None:
    consumer = Consumer("http://unused", "g")

    @consumer.handler("a")
    async def on_a(message: Message) -> None:
        pass

    with pytest.raises(ConfigurationError, match="run_async"):
        consumer.run()


def test_run_needs_handlers() -> None:
    with pytest.raises(ConfigurationError, match="no handlers"):
        Consumer("http://unused", "g").run()


def test_return_acks_and_exceptions_nack() -> None:
    ok = HandlerSpec(subject="orders", fn=lambda m: "ignored", guard=None)
    assert handle(ok, "g", _msg()) == Ack()

    def boom(message: Message) -> None:
        raise KeyError("no such order")

    nack = handle(HandlerSpec(subject="orders", fn=boom, guard=None), "g", _msg())
    assert isinstance(nack, Nack)
    assert nack.delay_ms is None
    assert nack.error == "KeyError: 'no such order'"


def test_retry_later_chooses_the_delay() -> None:
    def later(message: Message) -> None:
        raise RetryLater(timedelta(seconds=2.5), "rate limited")

    assert handle(HandlerSpec(subject="o", fn=later, guard=None), "g", _msg()) == Nack(
        delay_ms=2500, error="RetryLater: rate limited"
    )
    assert RetryLater(0.25).delay_ms == 250
    with pytest.raises(ValueError, match="negative"):
        RetryLater(-1)


def test_a_held_claim_is_retried_after_the_lease() -> None:
    def held(message: Message) -> None:
        raise ClaimHeld("busy", retry_after=timedelta(milliseconds=1500))

    result = handle(HandlerSpec(subject="o", fn=held, guard=None), "g", _msg())
    assert isinstance(result, Nack)
    assert result.delay_ms == 1500


def test_long_errors_are_truncated() -> None:
    def boom(message: Message) -> None:
        raise ValueError("x" * 10_000)

    result = handle(HandlerSpec(subject="o", fn=boom, guard=None), "g", _msg())
    assert isinstance(result, Nack)
    assert len(result.error) == 2000


async def test_async_handlers_are_awaited_and_sync_ones_run_in_a_thread() -> None:
    seen: list[str] = []

    async def coroutine(message: Message) -> None:
        seen.append("async")

    def plain(message: Message) -> None:
        seen.append("sync")

    assert (
        await handle_async(HandlerSpec(subject="o", fn=coroutine, guard=None), "g", _msg()) == Ack()
    )
    assert await handle_async(HandlerSpec(subject="o", fn=plain, guard=None), "g", _msg()) == Ack()

    async def later(message: Message) -> None:
        raise RetryLater(1)

    result = await handle_async(HandlerSpec(subject="o", fn=later, guard=None), "g", _msg())
    assert result == Nack(delay_ms=1000, error="RetryLater: retry in 1s")
    assert seen == ["async", "sync"]


def test_broadcast_consumers_dedup_each_on_their_own() -> None:
    shared = Consumer("http://unused", "billing", consumer_id="node-1")
    assert shared.config.store_group == "billing"
    node = Consumer("http://unused", "caches", consumer_id="node-1", mode="broadcast")
    assert node.config.store_group == "caches@node-1"
    long = Consumer("http://unused", "g" * 200, consumer_id="n" * 100, mode="broadcast")
    assert len(long.config.store_group) <= 200
    assert (
        long.config.store_group
        != Consumer(
            "http://unused", "g" * 200, consumer_id="m" * 100, mode="broadcast"
        ).config.store_group
    )
