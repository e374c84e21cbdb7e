"""The switches, clock and introspection of ``qmq_outbox.testing`` (its API v1 behaviour is
checked against a real broker by ``tests/contract``)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable
from qmq_outbox.testing import InMemoryBroker, StepClock


def msg(i: int, subject: str = "orders", **fields: object) -> OutgoingMessage:
    return OutgoingMessage(id=f"m{i}", subject=subject, body=b"{}", **fields)  # type: ignore[arg-type]


def test_unavailable_answers_503_and_counts_requests() -> None:
    broker = InMemoryBroker()
    broker.available = False
    with broker.client() as client:
        with pytest.raises(BrokerUnavailable, match="503 recovering"):
            client.produce([msg(1)])
        assert not client.healthy()
    assert (broker.requests, broker.stored) == (2, [])


def test_a_lost_response_was_still_handled() -> None:
    broker = InMemoryBroker()
    broker.lose_responses = 1
    with broker.client() as client:
        with pytest.raises(BrokerUnavailable, match="response lost"):
            client.produce([msg(1)])
        assert [r.status for r in client.produce([msg(1)])] == ["duplicate"]
    assert broker.ids == {"m1": 1}
    assert [m["id"] for m in broker.stored] == ["m1"]


def test_forbidden_subjects_are_rejected_with_403() -> None:
    broker = InMemoryBroker()
    broker.forbidden_subjects.add("payments")
    with broker.client() as client, pytest.raises(BrokerRejected) as rejected:
        client.produce([msg(1), msg(2, subject="payments")])
    assert (rejected.value.status, rejected.value.code) == (403, "forbidden")
    assert rejected.value.field == "messages[1].subject"
    assert broker.stored == []


def test_the_step_clock_brings_delayed_messages_and_retries_due() -> None:
    clock = StepClock()
    broker = InMemoryBroker(clock=clock)
    with broker.client() as client:
        later = msg(1, deliver_at=datetime.fromtimestamp(clock(), UTC) + timedelta(minutes=5))
        assert client.produce([later])[0].status == "scheduled"
        assert client.pull("orders", "g", "c") == []
        clock.advance(301)
        (message,) = client.pull("orders", "g", "c")
        client.nack("orders", "g", "c", [message.seq])  # default backoff: 1 s
        assert client.pull("orders", "g", "c") == []
        clock.advance(1)
        assert [m.attempt for m in client.pull("orders", "g", "c")] == [2]
        clock.advance(30)  # the default ack timeout
        assert [m.attempt for m in client.pull("orders", "g", "c")] == [3]


def test_a_clock_step_wakes_a_parked_long_poll() -> None:
    clock = StepClock()
    broker = InMemoryBroker(clock=clock)
    got: list[int] = []
    with broker.client() as client:
        client.produce([msg(1)])
        (message,) = client.pull("orders", "g", "a")
        client.nack("orders", "g", "a", [message.seq], delay_ms=60_000)

        def waiter() -> None:
            got.extend(m.attempt for m in client.pull("orders", "g", "a", wait_ms=10_000))

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.1)
        began = time.monotonic()
        clock.advance(60)
        thread.join(5)
    assert got == [2]
    assert time.monotonic() - began < 1


async def test_an_async_long_poll_wakes_on_produce() -> None:
    broker = InMemoryBroker()
    async with broker.async_client() as client:
        waiting = asyncio.create_task(client.pull("orders", "g", "a", wait_ms=10_000))
        await asyncio.sleep(0.05)
        began = time.monotonic()
        await client.produce([msg(1)])
        (message,) = await asyncio.wait_for(waiting, 5)
    assert message.id == "m1"
    assert time.monotonic() - began < 1


def test_fail_answers_the_next_requests_to_one_operation_with_an_error() -> None:
    broker = InMemoryBroker()
    broker.fail("pull", times=2)
    with broker.client() as client:
        client.produce([msg(1)])
        for _ in range(2):
            with pytest.raises(BrokerUnavailable, match="503 recovering"):
                client.pull("orders", "g", "c")
        (message,) = client.pull("orders", "g", "c")
        broker.fail("ack", code="forbidden", times=None)
        for _ in range(2):
            with pytest.raises(BrokerRejected) as rejected:
                client.ack("orders", "g", "c", [message.seq])
            assert (rejected.value.status, rejected.value.code) == (403, "forbidden")
        assert broker.acked_seqs("orders", "g") == set()  # a failed request changes nothing
        broker.fail("ack", times=0)
        assert client.ack("orders", "g", "c", [message.seq]) == {"acked": 1, "unknown": []}
    with pytest.raises(ValueError, match="unknown operation"):
        broker.fail("fetch")
    with pytest.raises(ValueError, match="unknown error code"):
        broker.fail("pull", code="teapot")


def test_received_keeps_each_operations_requests_failed_ones_included() -> None:
    broker = InMemoryBroker(max_attempts=1)
    with broker.client() as client:
        client.produce([msg(1), msg(2)])
        broker.fail("pull")
        with pytest.raises(BrokerUnavailable):
            client.pull("orders", "g", "c", max_messages=5)
        first, second = client.pull("orders", "g", "c", max_messages=5)
        client.ack("orders", "g", "c", [first.seq])
        client.nack("orders", "g", "c", [second.seq], error="boom")
        client.dead_letters("orders", "g", limit=10)
    pulls = broker.received("pull")
    assert [(p["max"], p["consumer"]) for p in pulls] == [(5, "c"), (5, "c")]
    assert broker.received("ack") == [
        {"subject": "orders", "group": "g", "consumer": "c", "seqs": [first.seq]}
    ]
    (nack,) = broker.received("nack")
    assert (nack["seqs"], nack["delay_ms"], nack["error"]) == ([second.seq], None, "boom")
    assert broker.received("dead_letters") == [{"limit": "10"}]
    assert [m["id"] for m in broker.received("produce")[0]["messages"]] == ["m1", "m2"]
    assert broker.requests == 6
    with pytest.raises(ValueError, match="unknown operation"):
        broker.received("acks")


def test_most_leased_is_a_consumers_peak_over_its_groups_subjects() -> None:
    clock = StepClock()
    broker = InMemoryBroker(ack_timeout=30, clock=clock)
    with broker.client() as client:
        client.produce([msg(i) for i in range(3)] + [msg(i, subject="refunds") for i in (3, 4)])
        held = client.pull("orders", "g", "c", max_messages=2)
        client.pull("refunds", "g", "c", max_messages=1)
        client.pull("orders", "other", "c", max_messages=3)  # another group: counted apart
        client.pull("orders", "g", "d", max_messages=1)  # another consumer of the group
        assert broker.most_leased("g", "c") == 3
        client.ack("orders", "g", "c", [m.seq for m in held])
        client.pull("refunds", "g", "c", max_messages=1)
        assert broker.most_leased("g", "c") == 3  # the peak stays
        clock.advance(31)  # every lease expired: no longer held
        client.pull("refunds", "g", "c", max_messages=1)
    assert broker.most_leased("g", "c") == 3
    assert (broker.most_leased("other", "c"), broker.most_leased("g", "d")) == (3, 1)
    assert broker.most_leased("g", "nobody") == 0


def test_acked_and_dead_seqs_follow_acks_nacks_and_redrive() -> None:
    broker = InMemoryBroker(max_attempts=1)
    assert (broker.acked_seqs("orders", "g"), broker.dead_seqs("orders", "g")) == (set(), set())
    with broker.client() as client:
        client.produce([msg(i) for i in range(3)])
        client.pull("orders", "g", "c")
        client.ack("orders", "g", "c", [0, 2])
        client.nack("orders", "g", "c", [1])
        assert (broker.acked_seqs("orders", "g"), broker.dead_seqs("orders", "g")) == (
            {0, 2},
            {1},
        )
        assert client.redrive("orders", "g") == 1
        assert broker.dead_seqs("orders", "g") == set()
        client.pull("orders", "g", "c")
        client.ack("orders", "g", "c", [1])
    assert broker.acked_seqs("orders", "g") == {0, 1, 2}


def test_the_snippets_of_docs_testing_md_run_as_written() -> None:
    text = (Path(__file__).parents[2] / "docs" / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 4
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "docs/testing.md", "exec"), namespace)
