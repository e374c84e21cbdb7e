"""Pull, ack, nack, retries, lease expiry, dead letters, redrive, broadcast and stats."""

from __future__ import annotations

import threading
import time
from typing import Any

from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from tests.contract.conftest import ACK_TIMEOUT_S, Target


def produce(target: Target, subject: str, count: int) -> None:
    messages = [
        OutgoingMessage(id=f"id-{i}", subject=subject, body=f"body-{i}".encode(), producer="tests")
        for i in range(count)
    ]
    assert {r.status for r in target.client.produce(messages)} == {"stored"}


def test_pull_ack_and_subject_stats(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 3)
    first = target.client.pull(subject, "billing", "c1", max_messages=2)
    assert [(m.id, m.seq, m.attempt, m.producer) for m in first] == [
        ("id-0", 0, 1, "tests"),
        ("id-1", 1, 1, "tests"),
    ]
    assert first[0].body == b"body-0"
    assert first[0].created_at is not None
    assert first[0].stored_at is not None
    assert target.client.ack(subject, "billing", "c1", [0, 1, 0, 7]) == {
        "acked": 2,
        "unknown": [7],
    }
    stats = target.client.subject(subject)
    assert (stats["subject"], stats["messages"], stats["first_seq"], stats["next_seq"]) == (
        subject,
        3,
        0,
        3,
    )
    assert stats["bytes"] > 0
    assert stats["groups"] == [
        {
            "group": "billing",
            "mode": "shared",
            "backlog": 1,
            "in_flight": 0,
            "retrying": 0,
            "dead": 0,
            "acked": 2,
            "filtered": 0,
            "tags": [],
        }
    ]
    listed = {s["subject"]: s for s in target.client.subjects()}
    assert listed[subject]["next_seq"] == 3


def test_a_pull_carries_the_acks_of_the_previous_batch(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 5)
    first = target.client.pull(subject, "g", "c1", max_messages=2)
    assert [m.seq for m in first] == [0, 1]
    second = target.client.ack_and_pull(subject, "g", "c1", [0, 1, 1, 9], max_messages=2)
    assert [m.seq for m in second.messages] == [2, 3]
    assert (second.acked, second.unknown) == (2, [9])
    # another consumer's seqs are not its to ack; the pull is served all the same
    third = target.client.ack_and_pull(subject, "g", "c2", [2, 3], max_messages=5)
    assert [m.seq for m in third.messages] == [4]
    assert (third.acked, third.unknown) == (0, [2, 3])
    # a long poll that finds nothing still answers the acks it carried
    last = target.client.ack_and_pull(subject, "g", "c1", [2, 3], wait_ms=100)
    assert (last.messages, last.acked, last.unknown) == ([], 2, [])
    group = target.client.subject(subject)["groups"][0]
    assert (group["acked"], group["in_flight"], group["backlog"]) == (4, 1, 0)
    # a plain pull answers without the ack keys
    plain = target.post("/v1/pull", {"subject": subject, "group": "g", "consumer": "c1"})
    assert plain.json() == {"messages": []}


def test_a_pull_lingers_for_min_messages_then_takes_what_is_there(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 2)
    began = time.monotonic()
    lingered = target.client.pull(
        subject, "g", "c", max_messages=10, min_messages=5, linger_ms=300, wait_ms=5_000
    )
    waited = time.monotonic() - began
    assert [m.seq for m in lingered] == [0, 1]  # fewer than min once the linger ran out
    assert 0.25 <= waited < 2.5
    # enough there: answered at once
    produce_more = [
        OutgoingMessage(id=f"more-{i}", subject=subject, body=b"x", producer="tests")
        for i in range(6)
    ]
    target.client.produce(produce_more)
    began = time.monotonic()
    full = target.client.pull(
        subject, "g", "c", max_messages=10, min_messages=5, linger_ms=5_000, wait_ms=5_000
    )
    assert len(full) == 6
    assert time.monotonic() - began < 1.0


def waiting_client(target: Target) -> BrokerClient:
    """A second client for a long poll on another thread, on the target's transport (the
    in-memory broker has no other way in). Not closed by the test: closing it would close
    that shared transport, maybe under a produce of the main thread still reading its
    answer; the target's own client closes the transport when the test ends."""
    return BrokerClient(target.base_url, transport=target.client._http._transport)


def test_a_lingering_pull_answers_once_min_messages_arrive(target: Target) -> None:
    subject = target.subject()
    result: dict[str, Any] = {}

    own = waiting_client(target)

    def waiter() -> None:
        result["messages"] = own.pull(
            subject, "g", "a", max_messages=10, min_messages=3, linger_ms=10_000, wait_ms=10_000
        )
        result["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    produce(target, subject, 1)  # one is not enough: the pull keeps waiting
    time.sleep(0.3)
    assert "at" not in result
    more = [
        OutgoingMessage(id=f"more-{i}", subject=subject, body=b"x", producer="tests")
        for i in range(2)
    ]
    produced_at = time.monotonic()
    target.client.produce(more)
    thread.join(5)
    assert len(result["messages"]) == 3
    assert result["at"] - produced_at < 1.0


def test_shared_group_divides_and_latest_skips_the_backlog(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 5)
    assert [m.seq for m in target.client.pull(subject, "g", "a", max_messages=2)] == [0, 1]
    assert [m.seq for m in target.client.pull(subject, "g", "b", max_messages=9)] == [2, 3, 4]
    assert target.client.pull(subject, "late", "a", start="latest") == []
    produce_more = OutgoingMessage(id="id-9", subject=subject, body=b"x")
    assert target.client.produce([produce_more])[0].seq == 5
    assert [m.seq for m in target.client.pull(subject, "late", "a")] == [5]


def test_nack_retries_then_dead_letters_then_redrive(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 2)
    (first,) = target.client.pull(subject, "g", "a", max_messages=1)
    assert target.client.nack(subject, "g", "a", [first.seq], delay_ms=0, error="later") == {
        "retrying": 1,
        "dead": 0,
    }
    again = target.client.pull(subject, "g", "a", max_messages=5)
    assert [(m.seq, m.attempt) for m in again] == [(0, 2), (1, 1)]  # due retries first
    assert target.client.nack(subject, "g", "a", [0], error="boom") == {"retrying": 0, "dead": 1}
    page = target.client.dead_letters(subject, "g")
    assert page["next_after_seq"] is None
    (dead,) = page["dead"]
    assert (dead["seq"], dead["attempts"], dead["error"], dead["consumer"]) == (0, 2, "boom", None)
    assert dead["message"]["id"] == "id-0"
    assert target.client.subject(subject)["groups"][0]["dead"] == 1
    assert target.client.redrive(subject, "g", [0, 5]) == 1
    assert [(m.seq, m.attempt) for m in target.client.pull(subject, "g", "a")] == [(0, 1)]


def test_dead_letter_pages_and_redrive_all(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 5)
    seqs = [m.seq for m in target.client.pull(subject, "g", "a", max_messages=5)]
    assert target.client.nack(subject, "g", "a", seqs, delay_ms=0)["retrying"] == 5
    seqs = [m.seq for m in target.client.pull(subject, "g", "a", max_messages=5)]
    assert target.client.nack(subject, "g", "a", seqs)["dead"] == 5
    page = target.client.dead_letters(subject, "g", limit=2)
    assert ([d["seq"] for d in page["dead"]], page["next_after_seq"]) == ([0, 1], 1)
    rest = target.client.dead_letters(subject, "g", limit=10, after_seq=1)
    assert ([d["seq"] for d in rest["dead"]], rest["next_after_seq"]) == ([2, 3, 4], None)
    assert target.client.redrive(subject, "g") == 5
    assert target.client.dead_letters(subject, "g")["dead"] == []


def test_an_expired_lease_is_a_failed_attempt(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 1)
    assert [m.attempt for m in target.client.pull(subject, "g", "a")] == [1]
    assert target.client.pull(subject, "g", "b") == []  # leased to a
    target.advance(ACK_TIMEOUT_S + 0.2)
    assert [(m.seq, m.attempt) for m in target.client.pull(subject, "g", "b")] == [(0, 2)]
    target.advance(ACK_TIMEOUT_S + 0.2)
    assert target.client.pull(subject, "g", "b") == []  # out of attempts: dead
    (dead,) = target.client.dead_letters(subject, "g")["dead"]
    assert (dead["seq"], dead["attempts"], dead["error"]) == (0, 2, "lease expired")


def test_broadcast_gives_every_consumer_every_message(target: Target) -> None:
    subject = target.subject()
    produce(target, subject, 3)
    for consumer in ("a", "b"):
        got = target.client.pull(subject, "notify", consumer, max_messages=9, mode="broadcast")
        assert [m.seq for m in got] == [0, 1, 2]
    assert target.client.ack(subject, "notify", "a", [0, 1, 2])["acked"] == 3
    target.client.nack(subject, "notify", "b", [1], delay_ms=0, error="x")
    assert target.client.pull(subject, "notify", "a", mode="broadcast") == []
    assert [
        (m.seq, m.attempt) for m in target.client.pull(subject, "notify", "b", mode="broadcast")
    ] == [(1, 2)]
    (group,) = target.client.subject(subject)["groups"]
    assert (group["mode"], group["acked"], group["in_flight"], group["backlog"]) == (
        "broadcast",
        3,
        3,
        0,
    )


def test_a_long_poll_answers_as_soon_as_a_message_arrives(target: Target) -> None:
    subject = target.subject()
    result: dict[str, Any] = {}

    own = waiting_client(target)

    def waiter() -> None:
        result["messages"] = own.pull(subject, "g", "a", wait_ms=10_000)
        result["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    produced_at = time.monotonic()
    produce(target, subject, 1)
    thread.join(5)
    assert [m.id for m in result["messages"]] == ["id-0"]
    assert result["at"] - produced_at < 1.0


def test_a_long_poll_times_out_empty(target: Target) -> None:
    began = time.monotonic()
    assert target.client.pull(target.subject(), "g", "a", wait_ms=200) == []
    assert 0.15 <= time.monotonic() - began < 2
