"""kill -9 the broker at random moments while producers and a consumer group run.

After every restart each message that was answered 200 is present (a resend of its id is
answered ``duplicate`` with the seq first returned); at the end every id is stored exactly
once, and every stored message was either acknowledged by the group before a crash or is
delivered to it afterwards.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.errors import BrokerError
from tests.support.broker_process import BrokerProcess

SUBJECT = "crash.test"
GROUP = "auditors"


class Load:
    """Producers and one consumer that record exactly what the broker confirmed."""

    def __init__(self, url: str, *, producers: int, seed: int) -> None:
        self.url = url
        self.acknowledged: dict[str, int] = {}  # id -> seq answered with 200
        self.acked_seqs: set[int] = set()  # seqs the group's ack was answered for
        self.ack_sent: set[int] = set()  # seqs in an ack the crash left unanswered
        self.unconfirmed: list[list[OutgoingMessage]] = []  # batches with no answer
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.counter = 0
        self.random = random.Random(seed)
        self.threads = [threading.Thread(target=self.produce, args=(i,)) for i in range(producers)]
        self.threads.append(threading.Thread(target=self.consume))

    def next_batch(self, worker: int) -> list[OutgoingMessage]:
        with self.lock:
            start = self.counter
            self.counter += 20
        return [
            OutgoingMessage(id=f"w{worker}-{n}", subject=SUBJECT, body=b"x" * 200, producer="crash")
            for n in range(start, start + 20)
        ]

    def produce(self, worker: int) -> None:
        with BrokerClient(self.url, timeout=5) as client:
            while not self.stop.is_set():
                batch = self.next_batch(worker)
                try:
                    results = client.produce(batch)
                except BrokerError:
                    with self.lock:
                        self.unconfirmed.append(batch)
                    time.sleep(0.02)
                    continue
                with self.lock:
                    for result in results:
                        assert result.seq is not None
                        self.acknowledged[result.id] = result.seq

    def consume(self) -> None:
        with BrokerClient(self.url, timeout=5) as client:
            while not self.stop.is_set():
                try:
                    messages = client.pull(SUBJECT, GROUP, "c1", max_messages=50, wait_ms=100)
                    if not messages:
                        continue
                    seqs = [m.seq for m in messages]
                    with self.lock:
                        self.ack_sent.update(seqs)
                    answer = client.ack(SUBJECT, GROUP, "c1", seqs)
                except BrokerError:
                    time.sleep(0.02)
                    continue
                unknown = set(answer["unknown"])
                with self.lock:
                    self.acked_seqs.update(s for s in seqs if s not in unknown)

    def run_for(self, seconds: float) -> None:
        self.stop.clear()
        self.threads = [
            threading.Thread(target=self.produce, args=(i,)) for i in range(len(self.threads) - 1)
        ] + [threading.Thread(target=self.consume)]
        for thread in self.threads:
            thread.start()
        time.sleep(seconds)

    def halt(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


def check_after_restart(client: BrokerClient, load: Load, *, since: int = 0) -> None:
    """Resend the confirmed ids from the ``since``-th on (in the order they were confirmed;
    0: all of them): each must come back duplicate with its original seq."""
    with load.lock:
        confirmed = dict(load.acknowledged)
        retry, load.unconfirmed = load.unconfirmed, []
    for batch in retry:  # what was in flight at the crash is resent, as the outbox would
        for result in client.produce(batch):
            assert result.seq is not None
            confirmed.setdefault(result.id, result.seq)
            assert confirmed[result.id] == result.seq
    with load.lock:
        load.acknowledged.update(confirmed)
    ids = list(confirmed)[since:]
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        results = client.produce(
            [
                OutgoingMessage(id=i, subject=SUBJECT, body=b"x" * 200, producer="crash")
                for i in chunk
            ]
        )
        lost = [(r.id, r.status) for r in results if r.status != "duplicate"]
        assert lost == [], f"confirmed messages missing after restart: {lost[:5]}"
        moved = [(r.id, r.seq, confirmed[r.id]) for r in results if r.seq != confirmed[r.id]]
        assert moved == [], f"seq changed after restart: {moved[:5]}"


def crash_cycles(
    broker: BrokerProcess, cycles: int, seed: int, *, full_check_every: int = 1
) -> None:
    """Kill -9 the broker under load ``cycles`` times. After each restart the ids confirmed
    since the last check are resent, and every ``full_check_every`` cycles (and after the
    last) all of them: checking all of them every cycle grows with the square of the
    cycles (the 200-cycle run would need some 80 minutes), while an old message a later
    crash lost is still caught, at most ``full_check_every`` cycles after."""
    rng = random.Random(seed)
    load = Load(broker.url, producers=3, seed=seed)
    checked = 0  # the ids confirmed before this many were checked after the last crash
    with BrokerClient(broker.url, timeout=10) as client:
        for cycle in range(1, cycles + 1):
            load.run_for(rng.uniform(0.15, 0.6))
            broker.kill9()
            load.halt()
            broker.restart()
            full = cycle % full_check_every == 0 or cycle == cycles
            check_after_restart(client, load, since=0 if full else checked)
            checked = len(load.acknowledged)

        stats = client.subject(SUBJECT)
        assert stats["messages"] == len(load.acknowledged), "some id was stored twice"
        # Drain the group: everything it did not get acknowledged must still reach it.
        delivered: set[int] = set()
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 3.0:  # > the 1 s ack timeout
            messages = client.pull(SUBJECT, GROUP, "drain", max_messages=1000, wait_ms=200)
            if messages:
                idle_since = time.monotonic()
                delivered.update(m.seq for m in messages)
                client.ack(SUBJECT, GROUP, "drain", [m.seq for m in messages])
        stored = set(load.acknowledged.values())
        # An ack that reached the broker counts even if the crash ate its answer.
        unanswered = load.ack_sent - load.acked_seqs
        lost_to_group = stored - load.acked_seqs - unanswered - delivered
        assert lost_to_group == set(), f"{len(lost_to_group)} messages lost to the group"
        # An answered ack was written before its answer (under any --ack-fsync): a killed
        # process loses none of them, so none of those messages comes again.
        acked_again = load.acked_seqs & delivered
        assert acked_again == set(), f"{len(acked_again)} acked messages delivered again"
    assert len(load.acknowledged) > 1000
    assert len(unanswered) < len(load.acked_seqs) / 10


@pytest.mark.parametrize("ack_fsync", ["always", "interval:1000"])
def test_kill_9_twenty_times_loses_nothing(
    broker_factory: type[BrokerProcess], tmp_path: Path, ack_fsync: str
) -> None:
    """Under ``--ack-fsync interval`` too: an ack is answered after its record is written,
    and the page cache outlives the process (only the OS going down can lose it)."""
    broker = broker_factory(
        tmp_path / "data",
        extra_args=[
            "--ack-fsync",
            ack_fsync,
            "--ack-timeout",
            "1s",
            "--checkpoint-interval",
            "300ms",
            "--segment-size",
            "1048576",
        ],
    ).start()
    crash_cycles(broker, cycles=20, seed=20261121)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_9_two_hundred_times_loses_nothing(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    broker = broker_factory(
        tmp_path / "data",
        extra_args=[
            "--ack-timeout",
            "1s",
            "--checkpoint-interval",
            "300ms",
            "--segment-size",
            "1048576",
        ],
    ).start()
    crash_cycles(broker, cycles=200, seed=7, full_check_every=20)
