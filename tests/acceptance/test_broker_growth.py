"""kill -9 a real broker at several fill levels: the index chunks and the dedup stores.

The fill crosses index chunk edges (16,384 seqs) and dedup store flushes (16,384 ids per
subject), so each restart recovers sealed chunks, runs written before the kill, and a
tail the runs did not cover yet. After every restart: the counts are the ones answered,
every sampled id (from the very first ones on) answers ``duplicate`` with the seq it got,
old seqs are served by a group reading from the start, and new ids are stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from tests.support.broker_process import BrokerProcess
from tests.support.metrics import metric

SUBJECTS = ("growth.a", "growth.b")
LEVELS = (12_000, 36_000, 70_000)  # messages stored when the broker is killed
BATCH = 500


def outgoing(n: int) -> OutgoingMessage:
    return OutgoingMessage(
        id=f"g-{n}", subject=SUBJECTS[n % 2], body=f"{n}".encode(), producer="growth"
    )


def fill(client: BrokerClient, start: int, stop: int, seqs: dict[int, int]) -> None:
    for first in range(start, stop, BATCH):
        numbers = range(first, min(first + BATCH, stop))
        for subject in SUBJECTS:  # one subject per request, as a producer would batch
            batch = [n for n in numbers if SUBJECTS[n % 2] == subject]
            answers = client.produce([outgoing(n) for n in batch])
            assert {a.status for a in answers} == {"stored"}
            seqs.update(
                (n, a.seq) for n, a in zip(batch, answers, strict=True) if a.seq is not None
            )


@pytest.mark.timeout(600)
def test_kill_9_at_every_fill_level_keeps_counts_dedup_and_reads(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "data", extra_args=["--fsync", "never"]).start()
    seqs: dict[int, int] = {}
    stored = 0
    try:
        for level in LEVELS:
            with BrokerClient(broker.url) as client:
                fill(client, stored, level, seqs)
            stored = level
            broker.kill9()
            broker.restart()
            with BrokerClient(broker.url) as client:
                for subject in SUBJECTS:
                    detail = client.subject(subject)
                    assert detail["messages"] == stored // 2
                    assert detail["next_seq"] == stored // 2
                sample = [*range(0, 40), *range(16_380, 16_400), *range(stored - 40, stored)]
                sample = [n for n in sample if n < stored]
                answers = client.produce([outgoing(n) for n in sample])
                assert [(a.status, a.seq) for a in answers] == [
                    ("duplicate", seqs[n]) for n in sample
                ]
                pulled = client.pull(SUBJECTS[0], f"reader-{level}", "c", max_messages=3)
                assert [(m.seq, m.id) for m in pulled] == [(0, "g-0"), (1, "g-2"), (2, "g-4")]
        # the dedup stores wrote runs before the kills: recovery opened them, not just a tail
        runs = sorted((tmp_path / "data" / "dedup" / SUBJECTS[0]).glob("*.run"))
        assert runs != []
        # what stays in memory: each subject's newest index chunk, and the filter
        held = metric(broker.url, "qmq_broker_index_memory_bytes")
        assert held == sum((stored // 2) % 16_384 for _ in SUBJECTS) * 32
        assert 0 < metric(broker.url, "qmq_broker_dedup_filter_bytes") <= 4 * stored
        assert metric(broker.url, "qmq_broker_dedup_recent_ids") <= 2 * 16_384
        with BrokerClient(broker.url) as client:
            fresh = client.produce([outgoing(stored), outgoing(stored + 1)])
            assert [(a.status, a.seq) for a in fresh] == [
                ("stored", stored // 2),
                ("stored", stored // 2),
            ]
    finally:
        broker.stop()
