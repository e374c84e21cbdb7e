"""bench/scale.py: a tiny run against a real broker subprocess, and the parts it relies on."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from bench._broker import BenchBroker
from bench.scale import (
    check_duplicates,
    fill,
    main,
    message_id,
    parse_args,
    requests,
    sample_numbers,
    wanted_gauges,
)


def test_a_small_run_reports_every_checkpoint_and_finds_every_duplicate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, report_path = tmp_path / "run", tmp_path / "report.json"
    status = main(
        [
            "--total=20000",
            "--checkpoints=10000,20000",
            "--settle=0.1",
            "--progress-every=5000",
            f"--data-dir={run_dir}",
            f"--json={report_path}",
        ]
    )

    out = capsys.readouterr().out
    assert status == 0
    report = json.loads(report_path.read_text())
    assert report["failed"] is False
    assert report["sample_size"] == 1000  # the first 5 % of 20,000
    assert report["sample_subjects"] == 4
    assert report["empty"]["rss"] > 0
    checkpoints = report["checkpoints"]
    assert [c["messages"] for c in checkpoints] == [10_000, 20_000]
    for checkpoint in checkpoints:
        assert checkpoint["duplicates"] == {"asked": 1000, "right": 1000, "wrong": []}
        assert checkpoint["recovered"]["messages"] == checkpoint["messages"]
        assert checkpoint["recovered"]["seconds"] is not None
        assert checkpoint["until_healthy_s"] > 0
        assert checkpoint["fill_rate"] > 0
        assert checkpoint["disk"] > checkpoint["messages"] * 100  # the bodies alone
        for reading in ("before_kill", "after_recovery", "after_round"):
            assert checkpoint[reading]["rss"] > 0
    assert checkpoints[1]["disk"] > checkpoints[0]["disk"]
    assert len(report["slopes_first_to_last"]) == 2
    # progress every 5,000 stored, the table rows and the slope rows
    for count in ("5,000", "10,000", "15,000", "20,000"):
        assert f"{count} stored" in out
    assert "| 10,000 | " in out
    assert "| 20,000 | " in out
    assert "| 1,000 / 1,000 |" in out
    assert "| empty -> 10,000 |" in out
    assert "| 10,000 -> 20,000 |" in out
    assert "FAILED" not in out
    assert not run_dir.exists()  # deleted without --keep


def test_the_duplicate_check_counts_a_wrong_seq_and_a_new_id_as_wrong(tmp_path: Path) -> None:
    settings = parse_args(["--total=400", "--batch=50", "--progress-every=1000000"])
    sample: dict[str, int | None] = {message_id(n): None for n in (0, 1, 2, 3, 101)}
    broker = BenchBroker(tmp_path / "data", "--fsync", "never")
    broker.start()
    try:
        asyncio.run(fill(broker.url, settings, start=0, end=100, sample_seqs=sample))
        assert all(isinstance(seq, int) for name, seq in sample.items() if name != "scale-101")
        first_seq = sample["scale-2"]
        assert first_seq is not None
        sample["scale-2"] = first_seq + 1  # a seq the broker did not give it
        check = asyncio.run(check_duplicates(broker.url, settings, sample))
    finally:
        broker.stop()
    assert (check.asked, check.right, check.passed) == (5, 3, False)
    assert len(check.wrong) == 2
    assert any(w.startswith("scale-2: duplicate") for w in check.wrong)
    assert any(w.startswith("scale-101: stored") for w in check.wrong)  # never produced before


@pytest.mark.parametrize(
    ("total", "first_checkpoint", "subjects"),
    [
        (20_000_000, 5_000_000, 4),
        (200_000, 50_000, 4),
        (20_000, 10_000, 4),
        (20_000, 10_000, 3),
        (100_000, 700, 7),
        (1000, 1000, 16),
        (10, 10, 16),
    ],
)
def test_the_sample_is_distinct_early_and_spread_over_the_subjects(
    total: int, first_checkpoint: int, subjects: int
) -> None:
    numbers = sample_numbers(total=total, first_checkpoint=first_checkpoint, subjects=subjects)
    span = min(1_000_000, max(1, total // 20), first_checkpoint)
    if span >= subjects:  # whole blocks of one number per subject
        span -= span % subjects
    assert len(numbers) == min(1000, span)
    assert len(set(numbers)) == len(numbers)
    assert all(0 <= n < span for n in numbers)
    per_subject = Counter(n % subjects for n in numbers)
    assert len(per_subject) == min(subjects, len(numbers))
    assert max(per_subject.values()) - min(per_subject.values()) <= 1
    if total == 20_000_000:  # spread over the whole first million, not bunched at its start
        assert max(numbers) > 990_000


@pytest.mark.parametrize(
    ("start", "end", "subjects", "batch"),
    [(0, 20_000, 4, 1000), (10_000, 20_000, 4, 1000), (7, 1234, 3, 100), (0, 5, 4, 1000)],
)
def test_requests_store_every_number_once_one_subject_each(
    start: int, end: int, subjects: int, batch: int
) -> None:
    made = list(requests(start, end, subjects=subjects, batch=batch))
    numbers = sorted(n for request in made for n in request.numbers)
    assert numbers == list(range(start, end))
    for request in made:
        assert 0 < len(request.numbers) <= batch
        assert {n % subjects for n in request.numbers} == {request.subject}


def test_only_gauges_naming_index_dedup_or_rss_are_kept() -> None:
    page = "\n".join(
        [
            "# HELP qmq_broker_index_bytes Index bytes in memory",
            "# TYPE qmq_broker_index_bytes gauge",
            "qmq_broker_index_bytes 123.0",
            "# TYPE qmq_broker_dedup_entries gauge",
            'qmq_broker_dedup_entries{subject="a b"} 7.0',
            "# TYPE qmq_broker_index_reads_total counter",
            "qmq_broker_index_reads_total 5.0",
            "# TYPE qmq_broker_connections_open gauge",
            "qmq_broker_connections_open 2.0",
            "process_rss_bytes 9.0",
        ]
    )
    assert wanted_gauges(page) == {
        "qmq_broker_index_bytes": 123.0,
        'qmq_broker_dedup_entries{subject="a b"}': 7.0,
        "process_rss_bytes": 9.0,
    }


def test_a_used_data_dir_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep-me").write_text("x")
    assert main(["--total=100", f"--data-dir={used}"]) == 2
    assert "must be absent or an empty directory" in capsys.readouterr().err
    assert (used / "keep-me").read_text() == "x"


def test_a_run_too_big_for_the_disk_is_refused_before_anything_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(["--total=100000000000000", f"--data-dir={run_dir}"]) == 2
    assert "not enough free space" in capsys.readouterr().err
    assert not run_dir.exists()


def test_the_default_checkpoints_are_a_quarter_a_half_and_all_of_the_total() -> None:
    assert parse_args([]).checkpoints == (5_000_000, 10_000_000, 20_000_000)
    assert parse_args(["--total=200000"]).checkpoints == (50_000, 100_000, 200_000)
    assert parse_args(["--total=300", "--checkpoints=100"]).checkpoints == (100, 300)
