"""The compensator's backlog gauges and dead counter, from ``OutboxStore.backlog`` reads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import generate_latest

from qmq_outbox.compensator.metrics import MAX_SUBJECTS, CompensatorMetrics
from qmq_outbox.store import SubjectBacklog

NOW = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def backlog(
    subject: str, *, pending: int = 0, age_s: float | None = None, dead: int = 0
) -> SubjectBacklog:
    oldest = NOW - timedelta(seconds=age_s) if age_s is not None else None
    return SubjectBacklog(subject=subject, pending=pending, oldest_pending_at=oldest, dead=dead)


def test_totals_and_subjects_from_one_read() -> None:
    metrics = CompensatorMetrics()
    metrics.refresh(
        [backlog("a", pending=2, age_s=30, dead=1), backlog("b", pending=1, age_s=90)], NOW
    )
    text = generate_latest(metrics.registry).decode()
    assert "qmq_compensator_pending_messages 3.0" in text
    assert "qmq_compensator_oldest_pending_age_seconds 90.0" in text
    assert "qmq_compensator_dead_rows 1.0" in text
    assert 'qmq_compensator_subject_pending_messages{subject="a"} 2.0' in text
    assert 'qmq_compensator_subject_oldest_pending_age_seconds{subject="b"} 90.0' in text
    assert 'qmq_compensator_subject_dead_rows{subject="a"} 1.0' in text
    metrics.refresh([], NOW)
    text = generate_latest(metrics.registry).decode()
    assert "qmq_compensator_oldest_pending_age_seconds 0.0" in text
    assert 'subject="a"' not in text


def test_dead_counter_counts_rows_marked_elsewhere_once() -> None:
    metrics = CompensatorMetrics()
    metrics.refresh([backlog("a", dead=5)], NOW)  # dead before it started: the gauge only
    assert metrics.dead._value.get() == 0
    metrics.refresh([backlog("a", dead=7)], NOW)  # a dispatcher marked two
    assert metrics.dead._value.get() == 2
    metrics.dead.inc(3)  # the compensator marked three itself
    metrics.refresh([backlog("a", dead=10)], NOW)
    assert metrics.dead._value.get() == 5
    metrics.refresh([backlog("a", dead=1)], NOW)  # retried by an operator
    metrics.refresh([backlog("a", dead=2)], NOW)
    assert metrics.dead._value.get() == 6


def test_subject_series_are_bounded_to_the_busiest() -> None:
    metrics = CompensatorMetrics()
    many = [backlog(f"s{i:04d}", pending=i) for i in range(MAX_SUBJECTS + 50)]
    metrics.refresh(many, NOW)
    text = generate_latest(metrics.registry).decode()
    assert text.count("qmq_compensator_subject_pending_messages{") == MAX_SUBJECTS
    assert f'subject="s{MAX_SUBJECTS + 49:04d}"' in text
    assert 'subject="s0000"' not in text
    assert f"qmq_compensator_pending_messages {float(sum(range(MAX_SUBJECTS + 50)))}" in text
