"""Ordered subjects (docs/architecture.md 3.6) on the fake and the real broker alike:
declaring, routing by key, ordered pulls one batch per partition, acks, nacks and dead
letters naming the partition, listings, routes and route changes (a split's keys wait
until the group consumed the partition it closed).

One consumer per subject: partition leases, which the fake leaves out, never come in.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest

from qmq_broker.http import answers
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerRejected
from qmq_wire.ordered import logic_partition
from tests.contract.conftest import MAX_ATTEMPTS, Target


@pytest.fixture(autouse=True)
def _routes_answers_checked(target: Target) -> Iterator[None]:
    """The suite's answer check (``conftest``) knows no model for the routes document: check
    those answers here against the broker's, and leave every other answer to it."""
    yield
    kept = []
    for method, path, status, body in target.answers.seen:
        routes = method == "PUT" or path.endswith("/routes") or "/partitions/" in path
        if routes and status == 200:
            answers.RoutesResponse.model_validate_json(body)
        elif routes:
            answers.ErrorResponse.model_validate_json(body)
        else:
            kept.append((method, path, status, body))
    target.answers.seen[:] = kept


def error(response: httpx.Response) -> tuple[int, str, str | None]:
    body = response.json()["error"]
    return response.status_code, body["code"], body["field"]


def keys_of(partitions: int, count: int = 1) -> list[list[str]]:
    """``count`` keys routed to each partition of a subject with ``partitions``."""
    bounds = [n * 1024 // partitions for n in range(partitions + 1)]
    found: list[list[str]] = [[] for _ in range(partitions)]
    for i in itertools.count():
        key = f"key-{i}"
        logic = logic_partition(key)
        partition = next(p for p in range(partitions) if bounds[p] <= logic < bounds[p + 1])
        if len(found[partition]) < count:
            found[partition].append(key)
        if all(len(keys) == count for keys in found):
            return found
    raise AssertionError("unreachable")


def declare(target: Target, partitions: int, **more: Any) -> str:
    subject = target.subject("ledger")
    target.client.declare_subject(subject, partitions=partitions, **more)
    return subject


def publish(target: Target, subject: str, messages: list[tuple[str, int]]) -> list[Any]:
    """(key, n) each, bodies ``{"key", "n"}``, ids ``<key>/<n>``."""
    outgoing = [
        OutgoingMessage(
            id=f"{key}/{n}", subject=subject, key=key, body=orjson.dumps({"key": key, "n": n})
        )
        for key, n in messages
    ]
    return target.client.produce(outgoing)


def pulled(messages: list[Any]) -> list[tuple[int | None, int, str, int]]:
    return [(m.partition, m.seq, m.json()["key"], m.attempt) for m in messages]


def test_declaring_answers_the_routes_and_refuses_a_different_declaration(
    target: Target,
) -> None:
    subject = target.subject("ledger")
    routes = target.client.declare_subject(subject, partitions=3)
    ranges = [{"lo": 0, "hi": 341, "partition": 0}, {"lo": 341, "hi": 682, "partition": 1}]
    ranges.append({"lo": 682, "hi": 1024, "partition": 2})
    assert routes == {
        "subject": subject,
        "ordered": True,
        "logic_partitions": 1024,
        "on_dead": "skip",
        "version": 1,
        "ranges": ranges,
        "history": [{"version": 1, "change": "create", "ranges": ranges, "closed": []}],
        "groups": [],
    }
    assert target.client.declare_subject(subject, partitions=3) == routes
    assert target.client.routes(subject) == routes
    with pytest.raises(BrokerRejected) as conflict:
        target.client.declare_subject(subject, partitions=2)
    assert (conflict.value.status, conflict.value.code, conflict.value.field) == (
        409,
        "subject_conflict",
        "partitions",
    )
    with pytest.raises(BrokerRejected) as dead_rule:
        target.client.declare_subject(subject, partitions=3, on_dead="block")
    assert dead_rule.value.code == "subject_conflict"

    plain = target.subject("plain")
    target.client.produce([OutgoingMessage(id="p-1", subject=plain, body=b"x")])
    with pytest.raises(BrokerRejected) as unordered:
        target.client.declare_subject(plain, partitions=1)
    assert (unordered.value.status, unordered.value.code, unordered.value.field) == (
        409,
        "subject_conflict",
        "subject",
    )
    served = target.subject("served")
    target.client.pull(served, "g", "c1")  # a pull makes a plain subject too
    with pytest.raises(BrokerRejected):
        target.client.declare_subject(served)


def test_invalid_declarations(target: Target) -> None:
    path = f"/v1/subjects/{target.subject('ledger')}"
    for body, expected in [
        ({"ordered": False}, (400, "invalid_ordered", "ordered")),
        ({}, (400, "missing_field", "ordered")),
        ({"ordered": True, "partitions": 0}, (400, "invalid_partitions", "partitions")),
        ({"ordered": True, "partitions": 65}, (400, "invalid_partitions", "partitions")),
        ({"ordered": True, "on_dead": "later"}, (400, "invalid_on_dead", "on_dead")),
        ({"ordered": True, "colour": "red"}, (400, "unknown_field", "colour")),
    ]:
        assert error(target.http.put(path, content=orjson.dumps(body))) == expected, body


def test_messages_need_a_key_cannot_be_delayed_and_land_on_their_partition(
    target: Target,
) -> None:
    subject = declare(target, 2)
    (low,), (high,) = keys_of(2)
    with pytest.raises(BrokerRejected) as keyless:
        target.client.produce(
            [
                OutgoingMessage(id="a", subject=subject, key=low, body=b"x"),
                OutgoingMessage(id="b", subject=subject, body=b"x"),
            ]
        )
    assert (keyless.value.status, keyless.value.code, keyless.value.field) == (
        409,
        "key_required",
        "messages[1].key",
    )
    soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    later = {"id": "c", "subject": subject, "key": low, "body": "x", "deliver_at": soon}
    response = target.post("/v1/messages", {"messages": [later]})
    assert error(response) == (409, "delay_not_ordered", "messages[0].deliver_at")
    assert target.client.subject(subject)["messages"] == 0  # all or nothing

    results = publish(target, subject, [(low, 0), (high, 0), (low, 1)])
    assert [(r.status, r.partition, r.seq) for r in results] == [
        ("stored", 0, 0),
        ("stored", 1, 0),
        ("stored", 0, 1),
    ]
    again = publish(target, subject, [(low, 1)])
    assert [(r.status, r.partition, r.seq) for r in again] == [("duplicate", 0, 1)]
    plain = target.subject("plain")
    mixed = target.client.produce(
        [
            OutgoingMessage(id="m-1", subject=plain, body=b"x"),
            OutgoingMessage(id=f"{high}/1", subject=subject, key=high, body=b'{"n": 1}'),
        ]
    )
    assert [(r.subject, r.partition, r.seq) for r in mixed] == [(plain, None, 0), (subject, 1, 1)]
    raw = target.post(
        "/v1/messages", {"messages": [{"id": "m-2", "subject": plain, "body": "y"}]}
    ).json()
    assert "partition" not in raw["results"][0]  # absent for plain subjects


def test_a_partition_is_served_in_order_one_batch_at_a_time(target: Target) -> None:
    subject = declare(target, 2)
    (low,), (high,) = keys_of(2)
    publish(target, subject, [(low, 0), (low, 1), (low, 2)])
    first = target.client.pull(subject, "g", "c1", max_messages=2, mode="ordered")
    assert pulled(first) == [(0, 0, low, 1), (0, 1, low, 1)]
    # partition 0 waits for its batch's acks; partition 1 is served meanwhile
    publish(target, subject, [(high, 0)])
    second = target.client.pull(subject, "g", "c1", max_messages=5, mode="ordered")
    assert pulled(second) == [(1, 0, high, 1)]
    assert target.client.pull(subject, "g", "c1", max_messages=5, mode="ordered") == []
    assert target.client.ack(subject, "g", "c1", [0], partition=0) == {"acked": 1, "unknown": []}
    assert target.client.pull(subject, "g", "c1", max_messages=5, mode="ordered") == []
    assert target.client.ack(subject, "g", "c1", [1, 5], partition=0) == {
        "acked": 1,
        "unknown": [5],
    }
    third = target.client.pull(subject, "g", "c1", max_messages=5, mode="ordered")
    assert pulled(third) == [(0, 2, low, 1)]
    assert third[0].partition == 0
    assert target.client.ack(subject, "g", "c1", [2], partition=0)["acked"] == 1
    assert target.client.ack(subject, "g", "c1", [0], partition=1)["acked"] == 1

    stats = target.client.subject(subject)
    assert (stats["messages"], stats["first_seq"], stats["next_seq"]) == (4, 0, 4)
    assert stats["groups"] == [
        {
            "group": "g",
            "mode": "ordered",
            "backlog": 0,
            "in_flight": 0,
            "retrying": 0,
            "dead": 0,
            "acked": 4,
            "filtered": 0,
            "tags": [],
        }
    ]
    listed = {s["subject"]: s for s in target.client.subjects()}
    assert (listed[subject]["messages"], listed[subject]["next_seq"]) == (4, 4)
    assert not [name for name in listed if "#" in name]  # partitions are not listed
    assert target.client.routes(subject)["groups"] == [{"group": "g", "version": 1}]


@pytest.mark.parametrize("max_keys", [1, None])
def test_a_nack_brings_the_rest_of_the_batch_back_together_and_in_order(
    target: Target, max_keys: int | None
) -> None:
    """With one key: the retries come back together, an attempt counted for the first only
    (the others never ran); per key (the default) the key's next new message may join
    them, with ``max_keys`` 1 it waits for the next batch."""
    subject = declare(target, 1)
    publish(target, subject, [("k", n) for n in range(5)])
    keys = {"max_keys": max_keys, "mode": "ordered"}
    batch = target.client.pull(subject, "g", "c1", max_messages=4, **keys)
    assert [m.seq for m in batch] == [0, 1, 2, 3]
    assert target.client.ack(subject, "g", "c1", [0], partition=0)["acked"] == 1
    nacked = target.client.nack(
        subject, "g", "c1", [1, 2, 3], delay_ms=0, error="handler failed", partition=0
    )
    assert nacked == {"retrying": 3, "dead": 0}
    again = target.client.pull(subject, "g", "c1", max_messages=10, **keys)
    retried = [(1, 2), (2, 1), (3, 1)]
    assert [(m.seq, m.attempt) for m in again] == retried + ([(4, 1)] if max_keys is None else [])
    acked = [m.seq for m in again]
    assert target.client.ack(subject, "g", "c1", acked, partition=0)["acked"] == len(acked)
    rest = [m.seq for m in target.client.pull(subject, "g", "c1", **keys)]
    assert rest == ([] if max_keys is None else [4])


def test_a_retry_not_due_holds_back_the_ones_after_it(target: Target) -> None:
    subject = declare(target, 1)
    publish(target, subject, [("k", n) for n in range(4)])
    batch = target.client.pull(subject, "g", "c1", max_messages=3, mode="ordered")
    assert [m.seq for m in batch] == [0, 1, 2]
    assert target.client.nack(subject, "g", "c1", [0], delay_ms=60_000, partition=0) == {
        "retrying": 1,
        "dead": 0,
    }
    assert target.client.nack(subject, "g", "c1", [1, 2], delay_ms=0, partition=0)["retrying"] == 2
    assert target.client.pull(subject, "g", "c1", max_messages=10, mode="ordered") == []


def test_dead_letters_skip_or_block_the_partition(target: Target) -> None:
    for on_dead, after_death in [("skip", [1]), ("block", [])]:
        subject = declare(target, 1, on_dead=on_dead)
        publish(target, subject, [("k", 0), ("k", 1)])
        for _ in range(MAX_ATTEMPTS):
            (message,) = target.client.pull(subject, "g", "c1", max_messages=1, mode="ordered")
            assert message.seq == 0
            target.client.nack(subject, "g", "c1", [0], delay_ms=0, error="boom", partition=0)
        served = target.client.pull(subject, "g", "c1", max_messages=5, mode="ordered")
        assert [m.seq for m in served] == after_death, on_dead
        dead = target.client.dead_letters(subject, "g", partition=0)["dead"]
        assert [(d["seq"], d["attempts"], d["error"]) for d in dead] == [(0, MAX_ATTEMPTS, "boom")]
        assert dead[0]["message"]["partition"] == 0
        assert target.client.redrive(subject, "g", partition=0) == 1
        if on_dead == "block":
            # the redriven one comes back (a retry), its key's next one behind it
            served = target.client.pull(subject, "g", "c1", max_messages=5, mode="ordered")
            assert [(m.seq, m.attempt) for m in served] == [(0, 1), (1, 1)]
            assert target.client.ack(subject, "g", "c1", [0, 1], partition=0)["acked"] == 2


def test_ordered_calls_on_the_wrong_subject_or_without_a_partition(target: Target) -> None:
    subject = declare(target, 1)
    plain = target.subject("plain")
    target.client.produce([OutgoingMessage(id="p", subject=plain, body=b"x")])
    publish(target, subject, [("k", 0)])
    pull = {"subject": subject, "group": "g", "consumer": "c1"}
    assert error(target.post("/v1/pull", pull | {"mode": "shared"})) == (
        409,
        "mode_conflict",
        "mode",
    )
    assert error(target.post("/v1/pull", pull | {"mode": "ordered", "ack": [0]})) == (
        409,
        "partition_required",
        "ack",
    )
    plain_pull = pull | {"subject": plain, "mode": "ordered"}
    assert error(target.post("/v1/pull", plain_pull)) == (409, "not_ordered", "mode")
    target.client.pull(subject, "g", "c1", mode="ordered")
    target.client.pull(plain, "g", "c1")
    ack = {"subject": subject, "group": "g", "consumer": "c1", "seqs": [0]}
    assert error(target.post("/v1/ack", ack)) == (409, "partition_required", "partition")
    assert error(target.post("/v1/nack", ack)) == (409, "partition_required", "partition")
    plain_ack = ack | {"subject": plain, "partition": 0}
    assert error(target.post("/v1/ack", plain_ack)) == (409, "not_ordered", "partition")
    dead = f"/v1/subjects/{subject}/groups/g/dead"
    assert error(target.http.get(dead)) == (409, "partition_required", "partition")
    assert error(target.post(f"{dead}/redrive", {"all": True})) == (
        409,
        "partition_required",
        "partition",
    )
    plain_dead = f"/v1/subjects/{plain}/groups/g/dead"
    assert error(target.http.get(plain_dead, params={"partition": 0})) == (
        409,
        "not_ordered",
        "partition",
    )
    assert error(target.http.get(f"/v1/subjects/{plain}/routes")) == (409, "not_ordered", "subject")
    assert error(target.http.get("/v1/subjects/nope.never/routes")) == (
        404,
        "subject_not_found",
        "subject",
    )
    assert target.client.ack(subject, "g", "c1", [0], partition=0)["acked"] == 1


def test_route_changes_make_consecutive_versions_and_refuse_what_breaks_a_rule(
    target: Target,
) -> None:
    subject = declare(target, 2)
    split = target.client.split_partition(subject, partition=0, at=100)
    assert (split["version"], split["history"][-1]["closed"]) == (2, [0])
    assert [(r["lo"], r["hi"], r["partition"]) for r in split["ranges"]] == [
        (0, 100, 2),
        (100, 512, 3),
        (512, 1024, 1),
    ]
    merged = target.client.merge_partitions(subject, partitions=[2, 3])
    assert (merged["version"], merged["history"][-1]["closed"]) == (3, [2, 3])
    moved = target.client.move_partition(subject, partition=1)
    assert [r["partition"] for r in moved["ranges"]] == [4, 5]
    refusals = [
        (lambda: target.client.split_partition(subject, partition=0, at=100), "partition"),
        (lambda: target.client.split_partition(subject, partition=4, at=600), "at"),
        (lambda: target.client.merge_partitions(subject, partitions=[4, 4]), "partitions"),
        (lambda: target.client.move_partition(subject, partition=1), "partition"),
    ]
    for call, field in refusals:
        with pytest.raises(BrokerRejected) as refused:
            call()
        assert (refused.value.status, refused.value.code, refused.value.field) == (
            409,
            "route_conflict",
            field,
        )
    bad = target.http.post(f"/v1/subjects/{subject}/partitions/split", json={"partition": 4})
    assert error(bad) == (400, "missing_field", "at")
    with pytest.raises(BrokerRejected) as unknown:
        target.client.move_partition("nope.never", partition=0)
    assert (unknown.value.status, unknown.value.code) == (404, "subject_not_found")


def test_a_split_partitions_keys_wait_until_the_group_consumed_the_closed_one(
    target: Target,
) -> None:
    """Keys of partition 0 go to the new partitions after the split; the group gets them
    only once it has consumed what partition 0 still held, and its route version moves on
    then; a resend of an id stored before the split is a duplicate, found where it is."""
    subject = declare(target, 2)
    (low,), (high,) = keys_of(2)
    before = publish(target, subject, [(low, 0), (low, 1), (high, 0)])
    assert [r.partition for r in before] == [0, 0, 1]
    first = target.client.pull(subject, "g", "c1", mode="ordered", max_messages=10, wait_ms=0)
    split = target.client.split_partition(subject, partition=0, at=1)  # every key of 0 moves
    (new,) = [r["partition"] for r in split["ranges"] if r["lo"] == 1]
    after = publish(target, subject, [(low, 2), (low, 0)])
    assert [(r.status, r.partition) for r in after] == [("stored", new), ("duplicate", 0)]
    # The batch of partition 0 is still out: the new partition is not served yet.
    assert target.client.pull(subject, "g", "c1", mode="ordered", max_messages=10, wait_ms=0) == []
    assert target.client.routes(subject)["groups"] == [{"group": "g", "version": 1}]
    for partition in (0, 1):
        seqs = [m.seq for m in first if m.partition == partition]
        target.client.ack(subject, "g", "c1", seqs, partition=partition)
    then = target.client.pull(subject, "g", "c1", mode="ordered", max_messages=10, wait_ms=0)
    assert pulled(then) == [(new, 0, low, 1)]
    assert target.client.routes(subject)["groups"] == [{"group": "g", "version": 2}]
