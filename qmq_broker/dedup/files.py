"""A dedup store's directory, read and checked: on opening, the run headers that check out
and the saved filter, with what was wrong with the rest; offline, every run's body and the
filter against the runs (``qmq_broker.dedup.store``)."""

from __future__ import annotations

import itertools
from pathlib import Path

from qmq_broker.dedup.filter import FILTER_FILE, BloomFilter
from qmq_broker.dedup.runs import (
    TEMP_SUFFIX,
    MappedRun,
    RunHeader,
    parse_run_name,
    read_run_header,
    verify_run,
)
from qmq_broker.errors import CorruptRecord


def checked_runs(path: Path, problems: list[str]) -> tuple[list[RunHeader], int | None]:
    """The run headers that check out, by seq range; and the seq from which runs were lost.

    Deletes temporary files, runs wholly covered by another, runs whose header is damaged
    and every run above a damaged one (the caller re-adds those ids).
    """
    headers: list[RunHeader] = []
    damaged: list[tuple[int, int]] = []
    for entry in sorted(path.iterdir()):
        if entry.name.endswith(TEMP_SUFFIX):
            entry.unlink()
            continue
        if entry.name == FILTER_FILE:
            continue
        seqs = parse_run_name(entry.name)
        if seqs is None:
            problems.append(f"{entry}: not a dedup file, left alone")
            continue
        try:
            headers.append(read_run_header(entry))
        except CorruptRecord as exc:
            problems.append(f"{exc}: deleted")
            entry.unlink()
            damaged.append(seqs)
    # widest first, so a merged run is kept before the inputs it covers
    headers.sort(key=lambda h: (h.first_seq, -h.end_seq))
    kept: list[RunHeader] = []
    for header in headers:
        if kept and kept[-1].covers(header):
            (path / header.name).unlink()
        else:
            kept.append(header)
    lost = [
        first
        for first, end in damaged
        if not any(h.first_seq <= first and end <= h.end_seq for h in kept)
    ]
    lost += [b.first_seq for a, b in itertools.pairwise(kept) if b.first_seq < a.end_seq]
    if not lost:
        return kept, None
    lost_from = min(lost)
    above = [h for h in kept if h.first_seq >= lost_from]
    for header in above:
        (path / header.name).unlink()
    problems.append(
        f"{path}: ids of seqs from {lost_from} lost with damaged runs, {len(above)} runs "
        "above them deleted; they are re-added from the subject's index"
    )
    return [h for h in kept if h.first_seq < lost_from], lost_from


def saved_filter(path: Path, problems: list[str], *, runs: int) -> tuple[BloomFilter | None, int]:
    """``filter.bin`` and its runs_end; None when missing or damaged (reported if runs)."""
    filter_path = path / FILTER_FILE
    try:
        data = filter_path.read_bytes()
    except FileNotFoundError:
        if runs:
            problems.append(f"{filter_path} missing: rebuilt from {runs} runs")
        return None, 0
    try:
        return BloomFilter.decode(data, path=str(filter_path))
    except CorruptRecord as exc:
        problems.append(f"{exc}: rebuilt from the runs")
        return None, 0


def check_files(
    directory: Path, runs: list[MappedRun], bloom: BloomFilter, *, horizon: int
) -> list[str]:
    """What is wrong with a store's runs and saved filter (blocking, offline)."""
    problems: list[str] = []
    for run in runs:
        problems.extend(verify_run(run))
        missing = sum(bloom.contains_all(hashes) for hashes in run.live_hashes(horizon))
        if missing:
            problems.append(f"{run.path}: {missing} ids missing from the filter")
    path = directory / FILTER_FILE
    try:
        BloomFilter.decode(path.read_bytes(), path=str(path))
    except CorruptRecord as exc:
        problems.append(str(exc))
    except FileNotFoundError:
        problems.append(f"{path} missing")
    return problems
