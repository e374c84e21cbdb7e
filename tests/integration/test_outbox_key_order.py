"""Per-key order of outbox messages (docs/outbox.md, "Per-key order"), on PostgreSQL and
SQLite with a real broker: concurrent publishers, competing compensators over a backlog,
a failing row, a dead row, the dispatcher's holds, and unkeyed rows left as they were.

What the broker stored is read back by pulling the subject with a fresh group and sorting by
(partition, seq); per key it must equal the outbox's ``sent`` rows in id order, each once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox.client import BrokerClient
from qmq_outbox.compensator import Compensator
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import outbox_table
from qmq_outbox.store import OutboxStore, utcnow
from tests.support.broker_process import BrokerProcess
from tests.support.outbox import (
    clear_outbox,
    pending_rows,
    statuses,
    unique_subject,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)
ByKey = dict[str | None, list[str]]


@pytest.fixture(scope="module")
def broker(module_broker: BrokerProcess) -> BrokerProcess:
    return module_broker


@pytest.fixture
def late_broker(broker_factory: type[BrokerProcess], tmp_path: Path) -> BrokerProcess:
    """A broker whose port is known but that is not running (yet)."""
    return broker_factory(tmp_path / "late-broker")


# -- reading back ---------------------------------------------------------------------------


def declare_ordered(url: str, subject: str, partitions: int) -> None:
    body = {"ordered": True, "partitions": partitions}
    response = httpx.put(f"{url}/v1/subjects/{subject}", json=body, timeout=10)
    assert response.status_code == 200, response.text


def stored_by_key(url: str, subject: str, *, ordered: bool = False) -> ByKey:
    """What the broker stored on ``subject``: each key's message ids by (partition, seq)."""
    group, consumer = f"check-{uuid.uuid4().hex[:8]}", "checker"
    seen: list[tuple[int, int, str, str | None]] = []
    with httpx.Client(base_url=url, timeout=10) as http:
        empty = 0
        while empty < 3:  # an ordered pull may answer empty while it takes its partitions
            body = {"subject": subject, "group": group, "consumer": consumer, "max": 1000}
            body |= {"wait_ms": 0, "mode": "ordered" if ordered else "shared"}
            response = http.post("/v1/pull", json=body)
            if response.status_code == 404:
                break
            assert response.status_code == 200, response.text
            messages = response.json()["messages"]
            empty = 0 if messages else empty + 1
            partitions: dict[int, list[int]] = defaultdict(list)
            for m in messages:
                seen.append((m.get("partition") or 0, m["seq"], m["id"], m["key"]))
                partitions[m.get("partition") or 0].append(m["seq"])
            for partition, seqs in partitions.items() if ordered else ():
                ack: dict[str, Any] = {"subject": subject, "group": group}
                ack |= {"consumer": consumer, "partition": partition, "seqs": seqs}
                assert http.post("/v1/ack", json=ack).status_code == 200
    by_key: ByKey = defaultdict(list)
    for _, _, message_id, key in sorted(seen):
        by_key[key].append(message_id)
    return dict(by_key)


def outbox_order(engine: sa.Engine, subject: str) -> ByKey:
    """The outbox's sent rows of ``subject``: each key's message ids in id order."""
    t = outbox_table
    stmt = (
        sa.select(t.c.message_id, t.c.key)
        .where(t.c.subject == subject, t.c.status == "sent")
        .order_by(t.c.id)
    )
    by_key: ByKey = defaultdict(list)
    with engine.connect() as conn:
        for row in conn.execute(stmt):
            by_key[row.key].append(row.message_id)
    return dict(by_key)


def assert_key_order(stored: ByKey, expected: ByKey) -> None:
    """Keyed messages in outbox order, each once; unkeyed ones all there, in any order."""
    assert sorted(stored.pop(None, [])) == sorted(expected.pop(None, []))
    assert stored == expected


def keyed_rows(
    spec: Sequence[tuple[str, str | None]], *, subject: str, age: float = 300.0
) -> list[dict[str, Any]]:
    """Rows as ``publish()`` leaves them, one per (message id, key), created 1 ms apart."""
    start = datetime.now(UTC) - timedelta(seconds=age)
    rows: list[dict[str, Any]] = pending_rows(len(spec), subject=subject)
    for i, (row, (message_id, key)) in enumerate(zip(rows, spec, strict=True)):
        created = start + timedelta(milliseconds=i)
        row.update(message_id=message_id, key=key, created_at=created, next_attempt_at=created)
    return rows


def row_of(engine: sa.Engine, message_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(outbox_table).where(outbox_table.c.message_id == message_id)
        ).one()


def compensator(engine: sa.Engine, broker_url: str, **kwargs: Any) -> Compensator:
    options: dict[str, Any] = {"grace": timedelta(0), "batch_size": 500}
    options.update(kwargs)
    return Compensator(engine=engine, broker_url=broker_url, **options)


class Flaky(httpx.HTTPTransport):
    """Loses about one produce request in ``every``: half before the broker sees it, half
    after it stored the batch (the answer is lost, so the rows are sent again)."""

    def __init__(self, seed: int, every: int = 4) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.every = every
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/messages" or self.rng.randrange(self.every):
            return super().handle_request(request)
        self.lost += 1
        if self.rng.random() < 0.5:
            raise httpx.ConnectError("lost before the broker", request=request)
        super().handle_request(request).read()
        raise httpx.ReadTimeout("answer lost", request=request)


class FailOn(httpx.HTTPTransport):
    """Fails every produce request that carries ``message_id`` until ``healthy``."""

    def __init__(self, message_id: str) -> None:
        super().__init__()
        self.needle = f'"{message_id}"'.encode()
        self.healthy = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self.healthy and self.needle in request.read():
            raise httpx.ConnectError("broker unreachable for this one", request=request)
        return super().handle_request(request)


# -- the claim and the order check, on both databases -------------------------------------


def test_a_claim_takes_a_key_from_its_first_pending_row_in_id_order(engine: sa.Engine) -> None:
    subject = unique_subject("claim")
    store = OutboxStore(engine)
    spec = [("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b"), ("u0", None)]
    store.insert(keyed_rows(spec, subject=subject))

    def claim(limit: int, token: str) -> list[str]:
        rows = store.claim(
            token=token, now=utcnow(), grace=timedelta(0), lease=timedelta(minutes=1), limit=limit
        )
        return [row.message.id for row in rows]

    assert claim(1, "t1") == ["a0"]
    assert claim(2, "t2") == ["b0", "u0"]  # a1, a2 wait behind the leased a0: not in the LIMIT
    assert claim(10, "t3") == []
    assert store.mark_sent(ids=[row_of(engine, "a0").id], token="t1", now=utcnow()) == 1
    assert claim(10, "t4") == ["a1", "a2"]


def test_a_retried_first_row_goes_before_the_rest_of_its_key(engine: sa.Engine) -> None:
    """a0 was retried, so it is due after a1 and a2: it must still go first, and the LIMIT
    full of rows behind it must not starve it."""
    subject = unique_subject("retried")
    store = OutboxStore(engine)
    store.insert(keyed_rows([("a0", "a"), ("a1", "a"), ("a2", "a")], subject=subject))
    with engine.begin() as conn:
        retried = utcnow() - timedelta(seconds=1)
        conn.execute(
            sa.update(outbox_table)
            .where(outbox_table.c.message_id == "a0")
            .values(attempts=1, next_attempt_at=retried)
        )
    now, grace, lease = utcnow(), timedelta(0), timedelta(minutes=1)
    first = store.claim(token="t1", now=now, grace=grace, lease=lease, limit=1)
    assert [r.message.id for r in first] == ["a0"]
    assert store.mark_sent(ids=[first[0].id], token="t1", now=now) == 1
    rest = store.claim(token="t2", now=now, grace=grace, lease=lease, limit=10)
    assert [r.message.id for r in rest] == ["a1", "a2"]


def test_a_claim_that_could_not_lock_a_keys_first_row_leaves_the_rest(
    pg_url_migrated: str,
) -> None:
    """SKIP LOCKED passed over a0 (another transaction holds it): a1 and a2 must wait."""
    engine = sa.create_engine(pg_url_migrated)
    clear_outbox(engine)
    subject = unique_subject("skip")
    store = OutboxStore(engine)
    store.insert(keyed_rows([("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b")], subject=subject))
    with engine.begin() as other:
        other.execute(
            sa.select(outbox_table.c.id).where(outbox_table.c.message_id == "a0").with_for_update()
        )
        rows = store.claim(
            token="t1", now=utcnow(), grace=timedelta(0), lease=timedelta(minutes=1), limit=10
        )
        assert [r.message.id for r in rows] == ["b0"]
    assert statuses(engine, subject=subject) == dict.fromkeys(["a0", "a1", "a2", "b0"], "pending")
    assert row_of(engine, "a1").claim_token is None
    engine.dispose()


def test_the_order_check_lets_a_key_go_only_from_its_first_unsent_row(engine: sa.Engine) -> None:
    subject = unique_subject("check")
    store = OutboxStore(engine)
    spec = [("a0", "a"), ("a1", "a"), ("a2", "a"), ("a3", "a"), ("b0", "b"), ("b1", "b")]
    store.insert(keyed_rows(spec, subject=subject))
    with engine.begin() as conn:
        for message_id, status in (("a0", "sent"), ("b0", "dead")):
            conn.execute(
                sa.update(outbox_table)
                .where(outbox_table.c.message_id == message_id)
                .values(status=status)
            )
    ids = {m: row_of(engine, m).id for m, _ in spec}
    check = store.order_check(message_ids=["a3", "a2", "b1"])
    assert check.held == {"a2", "a3"}  # a1 is pending and not in this send
    assert check.sendable == {"b1": ids["b1"]}  # b0 is dead: it holds nothing back
    check = store.order_check(message_ids=["a2", "a1", "a0", "gone"])
    assert list(check.sendable) == ["a1", "a2"]  # in id order
    assert check.settled == {"a0", "gone"}
    assert not check.held
    check = store.order_check(message_ids=["a1", "a3"])
    assert list(check.sendable) == ["a1"]
    assert check.held == {"a3"}


# -- publishers, dispatcher and compensators against a real broker -------------------------


def test_concurrent_publishers_keep_each_keys_order(
    engine: sa.Engine, broker: BrokerProcess
) -> None:
    """Threads publish to a few keys in their own transactions while a compensator with no
    grace competes with the dispatcher; an ordered subject stores each key in id order."""
    subject, plain = unique_subject("concurrent"), unique_subject("plain")
    declare_ordered(broker.url, subject, partitions=3)
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url, batch_size=20)
    outbox.install(maker)
    comp = compensator(
        engine,
        broker.url,
        batch_size=15,
        interval=timedelta(milliseconds=20),
        backoff_base=timedelta(milliseconds=10),
        backoff_cap=timedelta(milliseconds=50),
    )
    comp.start()
    keys = ["k0", "k1", "k2", "k3"]
    threads_count, transactions = 8, 20
    barrier = threading.Barrier(threads_count)
    errors: list[BaseException] = []
    published: list[int] = []

    def publisher(n: int) -> None:
        rng = random.Random(n)
        try:
            barrier.wait()
            for _ in range(transactions):
                with maker.begin() as session:
                    for key in sorted(rng.sample(keys, rng.choice([1, 1, 2]))):
                        for _ in range(rng.randint(1, 3)):
                            outbox.publish(session, subject, {"n": n}, key=key)
                            published.append(1)
                    if rng.random() < 0.3:  # an ordered subject takes keyed messages only
                        outbox.publish(session, plain, {"n": n})
                    session.flush()  # ids drawn: later transactions may commit first
                    time.sleep(rng.choice([0.0, 0.001, 0.002, 0.02]))  # more work in between
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=publisher, args=(n,)) for n in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    try:
        assert not errors
        assert outbox.close(drain_timeout=30)
        wait_for(
            lambda: set(statuses(engine).values()) == {"sent"}, timeout=60, what="every row sent"
        )
    finally:
        assert comp.stop(10)
    expected = outbox_order(engine, subject)
    assert sum(len(ids) for ids in expected.values()) == len(published)
    assert_key_order(stored_by_key(broker.url, subject, ordered=True), expected)
    assert_key_order(stored_by_key(broker.url, plain), outbox_order(engine, plain))


def test_two_compensators_resend_a_backlog_in_each_keys_order(
    engine: sa.Engine, late_broker: BrokerProcess
) -> None:
    """The broker is down while the app publishes; then two compensators, each losing a
    quarter of its produce requests (before or after the broker stored them), resend."""
    subject = unique_subject("backlog")
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=late_broker.url)
    outbox.install(maker)
    rng = random.Random(7)
    for _ in range(60):
        with maker.begin() as session:
            for key in sorted(rng.choices(["a", "b", "c", "d", "e", None], k=5), key=str):
                outbox.publish(session, subject, {"x": 1}, key=key)
    assert outbox.close(drain_timeout=10)
    assert set(statuses(engine, subject=subject).values()) == {"pending"}
    late_broker.start()
    transports = [Flaky(seed) for seed in (1, 2)]
    workers = [
        Compensator(
            engine=engine,
            client=BrokerClient(late_broker.url, transport=transport),
            grace=timedelta(0),
            batch_size=20,
            backoff_base=timedelta(0),
            backoff_cap=timedelta(0),
            max_attempts=1000,
        )
        for transport in transports
    ]
    done = threading.Event()
    barrier = threading.Barrier(len(workers))
    errors: list[BaseException] = []
    claimed: list[int] = [0, 0]

    def run(index: int) -> None:
        try:
            barrier.wait()
            while not done.is_set():
                claimed[index] += workers[index].run_once().claimed
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    try:
        wait_for(
            lambda: errors or set(statuses(engine, subject=subject).values()) == {"sent"},
            timeout=90,
            what="every row sent",
        )
    finally:
        done.set()
        for thread in threads:
            thread.join(30)
        for worker in workers:
            worker.stop(5)
    assert not errors
    assert all(claimed), "both compensators should have taken part"
    assert all(transport.lost for transport in transports), "the flaky transports did fail"
    expected = outbox_order(engine, subject)
    assert sum(len(ids) for ids in expected.values()) == 300
    assert_key_order(stored_by_key(late_broker.url, subject), expected)


def test_a_failing_row_holds_back_its_key_but_not_other_keys(
    engine: sa.Engine, broker: BrokerProcess
) -> None:
    subject = unique_subject("failing")
    tag = uuid.uuid4().hex[:6]
    plan: list[tuple[str, str | None]] = [("a0", "a"), ("a1", "a"), ("a2", "a")]
    plan += [("b0", "b"), ("b1", "b"), ("u0", None)]
    spec = [(f"{tag}-{name}", key) for name, key in plan]
    names = {name.split("-")[1]: name for name, _ in spec}
    store = OutboxStore(engine)
    store.insert(keyed_rows(spec, subject=subject))
    transport = FailOn(names["a0"])
    comp = Compensator(
        engine=engine,
        client=BrokerClient(broker.url, transport=transport),
        grace=timedelta(0),
        batch_size=1,
        backoff_base=timedelta(hours=1),
        backoff_cap=timedelta(hours=1),
    )
    first = comp.run_once()
    assert (first.claimed, first.retried, first.unavailable) == (1, 1, 1)  # a0 failed
    second = comp.run_once()
    assert (second.claimed, second.sent) == (3, 3)
    assert statuses(engine, subject=subject) == {
        names["a0"]: "pending",
        names["a1"]: "pending",
        names["a2"]: "pending",
        names["b0"]: "sent",
        names["b1"]: "sent",
        names["u0"]: "sent",
    }
    assert [row_of(engine, names[n]).attempts for n in ("a0", "a1", "a2")] == [1, 0, 0]
    assert stored_by_key(broker.url, subject) == {
        "b": [names["b0"], names["b1"]],
        None: [names["u0"]],
    }
    assert store.order_check(message_ids=[names["a1"]]).held == {names["a1"]}
    with engine.begin() as conn:  # the hour passes, the broker takes a0 again
        conn.execute(
            sa.update(outbox_table)
            .where(outbox_table.c.message_id == names["a0"])
            .values(next_attempt_at=utcnow() - timedelta(seconds=1))
        )
    transport.healthy = True
    third = comp.run_once()
    comp.stop(5)
    assert third.sent == 3
    assert stored_by_key(broker.url, subject)["a"] == [names["a0"], names["a1"], names["a2"]]


def test_a_dead_row_no_longer_holds_back_its_key(engine: sa.Engine, broker: BrokerProcess) -> None:
    subject = unique_subject("dead")
    tag = uuid.uuid4().hex[:6]
    a = [f"{tag}-a{i}" for i in range(3)]
    rows = keyed_rows([(m, "a") for m in a], subject=subject)
    rows[0]["body"] = b"x" * (1024 * 1024 + 1)  # the broker answers 413: never storable
    OutboxStore(engine).insert(rows)
    comp = compensator(engine, broker.url, batch_size=10)
    result = comp.run_once()
    comp.stop(5)
    assert (result.sent, result.dead) == (2, 1)
    assert row_of(engine, a[0]).status == "dead"
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    with maker.begin() as session:
        a.append(outbox.publish(session, subject, {"x": 3}, key="a"))
    assert outbox.close()
    assert row_of(engine, a[3]).status == "sent"  # by the dispatcher, at once
    assert stored_by_key(broker.url, subject) == {"a": a[1:]}


def test_the_dispatcher_leaves_a_key_behind_a_row_it_never_had_to_the_compensator(
    engine: sa.Engine, broker: BrokerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """a0 committed without reaching the dispatcher (as after a crash): the dispatcher
    holds a1 and a2 for a while, sends the other key, then leaves key a to the compensator."""
    caplog.set_level(logging.DEBUG, logger="qmq_outbox.dispatcher")
    subject = unique_subject("behind")
    silent_maker, maker = sessionmaker(engine), sessionmaker(engine)
    silent = Outbox(dispatch=False)
    silent.install(silent_maker)
    with silent_maker.begin() as session:
        a = [silent.publish(session, subject, {"i": 0}, key="a")]
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    with maker.begin() as session:
        a.append(outbox.publish(session, subject, {"i": 1}, key="a"))
        b = outbox.publish(session, subject, {"i": 1}, key="b")
        u = outbox.publish(session, subject, {"i": 1})
    with maker.begin() as session:
        a.append(outbox.publish(session, subject, {"i": 2}, key="a"))
    assert outbox.close(drain_timeout=10)
    assert statuses(engine, subject=subject) == dict.fromkeys(a, "pending") | {b: "sent", u: "sent"}
    assert stored_by_key(broker.url, subject) == {"b": [b], None: [u]}
    held = [r for r in caplog.records if getattr(r, "action", None) == "outbox.order_held"]
    assert sum(getattr(r, "left", 0) for r in held) == 2  # a1 and a2, after their holds
    comp = compensator(engine, broker.url)
    assert comp.run_once().sent == 3
    comp.stop(5)
    assert stored_by_key(broker.url, subject)["a"] == a


def test_the_dispatcher_sends_a_held_row_once_its_earlier_row_went(
    engine: sa.Engine, broker: BrokerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """a1 is held behind a0, which the compensator sends meanwhile; the dispatcher's next
    try sends a1 itself (the compensator never claims it: it is still in its grace)."""
    caplog.set_level(logging.DEBUG, logger="qmq_outbox.dispatcher")
    subject = unique_subject("released")
    a0 = f"{uuid.uuid4().hex[:6]}-a0"
    OutboxStore(engine).insert(keyed_rows([(a0, "a")], subject=subject))
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    with maker.begin() as session:
        a1 = outbox.publish(session, subject, {"i": 1}, key="a")
    wait_for(
        lambda: any(getattr(r, "action", None) == "outbox.order_held" for r in caplog.records),
        what="a1 held",
    )
    comp = compensator(engine, broker.url, grace=timedelta(seconds=60))
    assert comp.run_once().sent == 1  # a0 only
    comp.stop(5)
    wait_for(lambda: row_of(engine, a1).status == "sent", what="a1 sent by the dispatcher")
    assert outbox.close()
    assert row_of(engine, a1).claim_token is None
    assert stored_by_key(broker.url, subject) == {"a": [a0, a1]}


def test_unkeyed_messages_take_no_lock_and_no_order_check(
    engine: sa.Engine, broker: BrokerProcess
) -> None:
    statements: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    subject = unique_subject("plain")
    maker = sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url)
    outbox.install(maker)
    for i in range(5):
        with maker.begin() as session:
            outbox.publish(session, subject, {"i": i})
            outbox.publish(session, subject, {"i": i})
    wait_for(lambda: set(statuses(engine, subject=subject).values()) == {"sent"})
    assert not [s for s in statements if "advisory" in s or "batch_cut" in s]
    with maker.begin() as session:
        outbox.publish(session, subject, {"i": 5}, key="k")
    assert outbox.close()
    assert [s for s in statements if "batch_cut" in s]
    locks = [s for s in statements if "pg_advisory_xact_lock" in s]
    assert len(locks) == (1 if engine.dialect.name == "postgresql" else 0)
    sa.event.remove(engine, "before_cursor_execute", _record)
    assert set(statuses(engine, subject=subject).values()) == {"sent"}


# -- PostgreSQL: same-key publishers queue, asyncio ------------------------------------------


def waiting_on_advisory_locks(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
                )
            ).scalar_one()
        )


def test_same_key_transactions_queue_at_their_write(pg_url_migrated: str) -> None:
    engine = sa.create_engine(pg_url_migrated)
    clear_outbox(engine)
    subject = unique_subject("queue")
    maker: sessionmaker[Session] = sessionmaker(engine)
    outbox = Outbox(dispatch=False)
    outbox.install(maker)
    first = maker()
    first.begin()
    savepoint = first.begin_nested()
    with first.begin_nested():  # its RELEASE writes the row, taking the key's lock
        outbox.publish(first, subject, {"n": 0}, key="k")
    assert waiting_on_advisory_locks(engine) == 0
    savepoint.rollback()  # gives back the key lock taken inside it
    with first.begin_nested():  # takes it again
        mine = outbox.publish(first, subject, {"n": 1}, key="k")
    done = threading.Event()
    theirs: list[str] = []

    def second() -> None:
        with maker.begin() as session:
            theirs.append(outbox.publish(session, subject, {"n": 2}, key="k"))
        done.set()

    thread = threading.Thread(target=second)
    thread.start()
    wait_for(lambda: waiting_on_advisory_locks(engine) == 1, what="second waits at its write")
    with maker.begin() as session:  # other keys and unkeyed messages do not wait
        outbox.publish(session, subject, {"n": 3}, key="other")
        outbox.publish(session, subject, {"n": 4})
    assert not done.is_set()
    first.commit()
    first.close()
    thread.join(10)
    assert done.is_set()
    assert row_of(engine, mine).id < row_of(engine, theirs[0]).id
    engine.dispose()


async def test_async_publishers_keep_each_keys_order(
    pg_url_migrated: str, broker: BrokerProcess
) -> None:
    check = sa.create_engine(pg_url_migrated)
    clear_outbox(check)
    subject = unique_subject("async")
    engine = create_async_engine(pg_url_migrated, pool_size=8)
    maker = async_sessionmaker(engine)
    outbox = Outbox(broker_url=broker.url, batch_size=10)
    outbox.install(engine)

    async def publisher(n: int) -> None:
        rng = random.Random(n)
        for _ in range(15):
            async with maker.begin() as session:
                for key in sorted(rng.sample(["a", "b", "c"], rng.choice([1, 2]))):
                    outbox.publish(session, subject, {"n": n}, key=key)
                    outbox.publish(session, subject, {"n": n}, key=key)

    await asyncio.gather(*(publisher(n) for n in range(6)))
    assert await outbox.aclose(drain_timeout=30)
    await engine.dispose()
    comp = compensator(check, broker.url)  # what the dispatcher left behind, if anything
    await asyncio.to_thread(comp.run_once)
    comp.stop(5)
    assert set(statuses(check, subject=subject).values()) == {"sent"}
    expected = outbox_order(check, subject)
    assert sum(len(ids) for ids in expected.values()) > 0
    assert_key_order(stored_by_key(broker.url, subject), expected)
    check.dispose()


def test_keyed_rows_inserted_out_of_creation_order_still_go_by_id(engine: sa.Engine) -> None:
    """Clocks of two app servers disagree: a later row of a key was created 'before' the
    earlier one. The claim still hands them out by id."""
    subject = unique_subject("skew")
    store = OutboxStore(engine)
    rows = keyed_rows([("a0", "a"), ("a1", "a")], subject=subject)
    rows[0]["created_at"] = rows[0]["next_attempt_at"] = datetime.now(UTC) - timedelta(seconds=10)
    store.insert(rows)
    now, grace, lease = utcnow(), timedelta(0), timedelta(minutes=1)
    claimed = [
        r.message.id for r in store.claim(token="t", now=now, grace=grace, lease=lease, limit=1)
    ]
    assert claimed == ["a0"]  # a1 is due first, but waits for its key's first row
    assert [
        r.message.id for r in store.claim(token="u", now=now, grace=grace, lease=lease, limit=5)
    ] == []
