"""The per-subject dedup store: runs on disk behind a Bloom filter, in bounded memory."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest

from qmq_broker.dedup import DedupStats, DedupStore
from qmq_broker.dedup.filter import FILTER_FILE, MIN_FILTER_IDS, BloomFilter
from qmq_broker.dedup.runs import RUN_HEADER_SIZE, RUN_SUFFIX, parse_run_name, read_run_header
from qmq_broker.errors import StorageError

FLUSH_AT = 1000
FAN_IN = 4


def random_hashes(count: int, *, seed: int) -> list[int]:
    """Uniform 64-bit hashes like ``qmq_broker.format.ids.id_hash``'s (distinct in practice)."""
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(count)]


def drain(store: DedupStore) -> None:
    """Run every planned job the way the broker does: plan, run (here inline), commit."""
    while (job := store.plan()) is not None:
        job.run()
        assert store.commit(job)


def fill(store: DedupStore, hashes: list[int], *, first_seq: int = 0) -> None:
    for seq, hashed in enumerate(hashes, start=first_seq):
        store.add(hashed, seq)
        drain(store)


def run_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(RUN_SUFFIX))


def size_class(count: int) -> int:
    found, limit = 0, FLUSH_AT * 4
    while count >= limit:
        found, limit = found + 1, limit * 4
    return found


def runs_bound(directory: Path) -> int:
    """Per size class up to the largest run's, fan_in - 1 runs on each side of what
    filter.bin holds (merges never mix the two sides), and one merge's worth in flight."""
    counts = [read_run_header(directory / name).count for name in run_files(directory)]
    classes = max(map(size_class, counts)) + 1 if counts else 0
    return 2 * (FAN_IN - 1) * classes + 1 if counts else 0


@dataclasses.dataclass
class Filled:
    """A store given 100k ids, and what was observed while it took them."""

    store: DedupStore
    hashes: list[int]
    most_recent_ids: int  # the largest recent + frozen count seen, inside jobs included
    most_recent_between_jobs: int
    worst_filter_ratio: float  # filter bytes / max(live ids, MIN_FILTER_IDS)
    runs_over_bound: list[tuple[int, int]]  # (runs, bound) whenever runs > bound


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Filled:
    store = DedupStore.open(
        tmp_path_factory.mktemp("dedup") / "orders", flush_at=FLUSH_AT, fan_in=FAN_IN
    )
    hashes = random_hashes(100_000, seed=1)
    most_recent = most_between = 0
    worst_ratio = 0.0
    over: list[tuple[int, int]] = []
    flushed = 0
    for seq, hashed in enumerate(hashes):
        store.add(hashed, seq)
        while (job := store.plan()) is not None:
            most_recent = max(most_recent, store.stats().recent_ids)  # the frozen dict too
            job.run()
            assert store.commit(job)
        stats = store.stats()
        most_between = max(most_between, stats.recent_ids)
        # no expiry here: every id in the runs is live
        worst_ratio = max(worst_ratio, stats.filter_bytes / max(stats.run_ids, MIN_FILTER_IDS))
        if stats.run_ids != flushed:  # a flush (and maybe merges) happened
            flushed = stats.run_ids
            bound = runs_bound(store.directory)
            if stats.runs > bound:
                over.append((stats.runs, bound))
    return Filled(store, hashes, most_recent, most_between, worst_ratio, over)


def test_every_added_id_is_found_with_its_seq(filled: Filled) -> None:
    found = [filled.store.find(hashed) for hashed in filled.hashes]
    assert found == list(range(len(filled.hashes)))
    stats = filled.store.stats()
    assert (stats.run_ids, stats.recent_ids) == (len(filled.hashes), 0)  # on disk, not in RAM


def test_absent_hashes_are_not_found_and_false_positives_stay_under_2_percent(
    filled: Filled,
) -> None:
    before = filled.store.stats()
    absent = random_hashes(100_000, seed=2)
    assert not set(absent) & set(filled.hashes)
    assert all(filled.store.find(hashed) is None for hashed in absent)
    after = filled.store.stats()
    lookups = after.filter_lookups - before.filter_lookups
    false_positives = after.filter_false_positives - before.filter_false_positives
    assert lookups == len(absent)
    assert 0 < false_positives < 0.02 * lookups


def test_filter_ram_stays_within_2_bytes_per_live_id(filled: Filled) -> None:
    # the documented bound while the window does not shrink:
    # filter bytes <= 2 x max(live ids, MIN_FILTER_IDS), at every step
    assert filled.worst_filter_ratio <= 2.0
    stats = filled.store.stats()
    assert stats.filter_bytes <= 2 * stats.run_ids
    assert stats.filter_ids == stats.run_ids


def test_recent_dict_never_exceeds_flush_at_plus_one_frozen(filled: Filled) -> None:
    assert filled.most_recent_between_jobs <= FLUSH_AT
    assert FLUSH_AT <= filled.most_recent_ids <= 2 * FLUSH_AT


def test_merges_keep_the_number_of_runs_logarithmic(filled: Filled) -> None:
    assert filled.runs_over_bound == []
    stats = filled.store.stats()
    assert stats.runs <= 2 * (FAN_IN - 1) * 4 + 1  # 100 flushes of 1000: size classes 0..3
    assert len(run_files(filled.store.directory)) == stats.runs  # merged inputs deleted


def test_expired_ids_are_not_found_and_expired_runs_are_deleted(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(10_500, seed=3)
    fill(store, hashes)  # 10 flushed runs' worth, 500 ids still in the recent dict
    assert store.stats().recent_ids == 500

    store.expire_below(6500)
    assert [store.find(hashed) for hashed in hashes[:6500]] == [None] * 6500
    assert [store.find(hashed) for hashed in hashes[6500:]] == list(range(6500, 10_500))
    drain(store)
    for name in run_files(tmp_path):
        seqs = parse_run_name(name)
        assert seqs is not None
        assert seqs[1] > 6500  # every run wholly below the horizon is gone from disk
    assert [store.find(hashed) for hashed in hashes[6500:]] == list(range(6500, 10_500))

    store.expire_below(10_200)
    assert store.stats().recent_ids == 300  # expired recent ids dropped at once
    drain(store)
    assert run_files(tmp_path) == []
    assert store.stats().runs == 0
    assert [store.find(hashed) for hashed in hashes[10_200:]] == list(range(10_200, 10_500))
    assert all(store.find(hashed) is None for hashed in hashes[:10_200])
    assert store.covered_end == 10_200


def test_merging_drops_expired_entries(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(6000, seed=4)
    fill(store, hashes[:3000])
    store.expire_below(1500)  # [0, 1000) wholly expired, [1000, 2000) half
    fill(store, hashes[3000:], first_seq=3000)
    assert run_files(tmp_path) == [
        "00000000000000001000-00000000000000005000.run",  # 1000..4999 merged
        "00000000000000005000-00000000000000006000.run",
    ]
    merged = read_run_header(tmp_path / run_files(tmp_path)[0])
    assert (merged.count, merged.min_seq) == (3500, 1500)  # 1000..1499 dropped
    assert store.stats().run_ids == 4500
    assert [store.find(hashed) for hashed in hashes[1500:]] == list(range(1500, 6000))
    assert all(store.find(hashed) is None for hashed in hashes[:1500])
    assert store.verify() == []


def test_the_filter_is_rebuilt_smaller_when_most_ids_expire(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(40_000, seed=16)
    fill(store, hashes)
    grown = store.stats()
    assert grown.filter_bytes > 2 * 20_000
    store.expire_below(36_000)
    drain(store)  # deletes the expired runs, rebuilds the filter from the live ids
    shrunk = store.stats()
    # the filter holds the live ids only; a run that straddles the horizon still holds
    # expired entries until a merge drops them
    assert shrunk.filter_ids == 4000
    assert shrunk.run_ids >= 4000
    assert shrunk.filter_bytes == 2 * MIN_FILTER_IDS  # sized for max(4000, the minimum)
    assert [store.find(hashed) for hashed in hashes[36_000:]] == list(range(36_000, 40_000))
    assert store.verify() == []
    store.close()
    reopened = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN, horizon=36_000)
    assert reopened.problems == []
    assert reopened.stats().filter_bytes == 2 * MIN_FILTER_IDS  # the rebuilt one was saved


def test_reopening_finds_every_id_and_reads_only_run_headers(tmp_path: Path) -> None:
    directory = tmp_path / "orders"
    store = DedupStore.open(directory, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(5500, seed=6)
    fill(store, hashes)
    store.flush_all()  # and then the process dies: no close()

    reopened = DedupStore.open(directory, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert reopened.problems == []
    assert reopened.covered_end == 5500  # the recent ids were flushed too
    assert [reopened.find(hashed) for hashed in hashes] == list(range(5500))
    assert reopened.verify() == []
    reopened.close()
    with pytest.raises(StorageError, match="closed"):
        reopened.find(hashes[0])

    # damage a run's body after the filter was saved: opening does not read it...
    oldest = directory / run_files(directory)[0]
    data = bytearray(oldest.read_bytes())
    data[RUN_HEADER_SIZE + 8] ^= 0xFF  # the second hash
    oldest.write_bytes(bytes(data))
    third = DedupStore.open(directory, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert third.problems == []
    # ...and the offline check does
    problems = third.verify()
    assert any(str(oldest) in problem and "hashes CRC mismatch" in problem for problem in problems)


def test_runs_written_after_the_filter_was_saved_are_added_to_it_on_open(
    tmp_path: Path,
) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(21_000, seed=17)
    fill(store, hashes[:20_000])
    store.flush_all()  # filter.bin holds the runs up to seq 20000
    fill(store, hashes[20_000:], first_seq=20_000)  # one more run; 5 % new ids: not saved
    _, runs_end = BloomFilter.decode((tmp_path / FILTER_FILE).read_bytes(), path="f")
    assert runs_end == 20_000
    assert store.covered_end == 21_000

    reopened = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)  # after a crash
    assert reopened.problems == []
    assert reopened.stats().filter_ids == 21_000
    assert [reopened.find(hashed) for hashed in hashes] == list(range(21_000))


def test_leftover_temporary_files_and_merge_inputs_are_cleaned_on_open(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(4000, seed=7)
    fill(store, hashes[:3000])
    pre_merge = {name: (tmp_path / name).read_bytes() for name in run_files(tmp_path)}
    assert len(pre_merge) == 3
    fill(store, hashes[3000:], first_seq=3000)  # the 4th flush, then the merge
    merged = run_files(tmp_path)
    assert merged == ["00000000000000000000-00000000000000004000.run"]
    store.close()

    # a crash after the merged run was durable but before its inputs were deleted,
    # and during the writing of a run and of the filter
    for name, data in pre_merge.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "00000000000000004000-00000000000000005000.run.tmp").write_bytes(b"torn")
    (tmp_path / (FILTER_FILE + ".tmp")).write_bytes(b"torn")

    reopened = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert reopened.problems == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [*merged, FILTER_FILE]
    assert reopened.stats().runs == 1
    assert [reopened.find(hashed) for hashed in hashes] == list(range(4000))


def test_a_damaged_filter_is_rebuilt_from_the_runs_and_reported(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(5000, seed=8)
    fill(store, hashes)
    store.close()
    path = tmp_path / FILTER_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))

    reopened = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert len(reopened.problems) == 1
    assert "filter bits CRC mismatch" in reopened.problems[0]
    assert "rebuilt" in reopened.problems[0]
    assert [reopened.find(hashed) for hashed in hashes] == list(range(5000))
    assert reopened.verify() == []  # rebuilt, holding every id, and saved again


def test_a_missing_filter_is_rebuilt_and_reported(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(2000, seed=9)
    fill(store, hashes)
    store.close()
    (tmp_path / FILTER_FILE).unlink()
    reopened = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert len(reopened.problems) == 1
    assert "missing" in reopened.problems[0]
    assert [reopened.find(hashed) for hashed in hashes] == list(range(2000))


def test_a_run_with_a_damaged_header_is_deleted_and_its_ids_re_added(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(5500, seed=10)
    fill(store, hashes)
    store.close()
    assert run_files(tmp_path) == [
        "00000000000000000000-00000000000000004000.run",
        "00000000000000004000-00000000000000005000.run",
        "00000000000000005000-00000000000000005500.run",
    ]
    middle = tmp_path / run_files(tmp_path)[1]
    data = bytearray(middle.read_bytes())
    data[16] ^= 0x01  # the count
    middle.write_bytes(bytes(data))

    reopened = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert any(str(middle) in problem for problem in reopened.problems)
    assert any("from 4000 lost" in problem for problem in reopened.problems)
    # the damaged run and the one above it are gone; the caller re-adds from covered_end
    assert run_files(tmp_path) == ["00000000000000000000-00000000000000004000.run"]
    assert reopened.covered_end == 4000
    assert [reopened.find(hashed) for hashed in hashes[:4000]] == list(range(4000))
    assert all(reopened.find(hashed) is None for hashed in hashes[4000:])
    fill(reopened, hashes[reopened.covered_end :], first_seq=reopened.covered_end)
    assert [reopened.find(hashed) for hashed in hashes] == list(range(5500))
    reopened.close()

    again = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert again.problems == []
    assert [again.find(hashed) for hashed in hashes] == list(range(5500))
    assert again.verify() == []


def test_a_hash_stored_twice_answers_the_larger_seq(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(4000, seed=11)
    twice = hashes[10]
    hashes[2500] = twice  # two ids with the same hash: seqs 10 and 2500
    fill(store, hashes[:3000])
    assert store.stats().runs == 3  # in different runs
    assert store.find(twice) == 2500
    fill(store, hashes[3000:], first_seq=3000)
    assert store.stats().runs == 1  # merged: one run, both entries
    assert store.find(twice) == 2500
    store.expire_below(2501)
    assert store.find(twice) is None


def test_seqs_below_what_was_flushed_are_ignored(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(1000, seed=12)
    fill(store, hashes)
    assert store.covered_end == 1000
    late = random_hashes(1, seed=13)[0]
    store.add(late, 999)  # already covered by a run
    assert store.find(late) is None
    store.add(late, 1000)
    assert store.find(late) == 1000


def test_add_many_is_add_of_each_in_turn(tmp_path: Path) -> None:
    one = DedupStore.open(tmp_path / "one", flush_at=FLUSH_AT, fan_in=FAN_IN)
    many = DedupStore.open(tmp_path / "many", flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(1200, seed=15)
    new = hashes[FLUSH_AT:]
    batch = [*new[:50], new[10], *new[50:60]]  # a hash twice: its newest seq wins
    fill(one, hashes[:FLUSH_AT])
    fill(many, hashes[:FLUSH_AT])
    assert many.covered_end == FLUSH_AT
    first = FLUSH_AT - 10  # the first ten seqs are below what was flushed
    for seq, hashed in enumerate(batch, first):
        one.add(hashed, seq)
    many.add_many(batch, first)
    assert many.find_many(hashes) == one.find_many(hashes)
    assert many.find(new[5]) is None  # its seq was below the flushed end: ignored, as by add
    assert many.find(new[10]) == first + 50
    assert many.find(new[59]) == first + 60


def test_a_job_committed_without_running_is_planned_again(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(FLUSH_AT, seed=14)
    for seq, hashed in enumerate(hashes):
        store.add(hashed, seq)
    job = store.plan()
    assert job is not None
    assert job.kind == "flush"
    assert store.plan() is None  # one job at a time
    assert store.find(hashes[0]) == 0  # the frozen dict is still consulted
    assert not store.commit(job)  # it never ran: nothing installed
    assert run_files(tmp_path) == []
    retry = store.plan()
    assert retry is not None
    assert retry.kind == "flush"
    retry.run()
    assert store.commit(retry)
    assert store.stats() == DedupStats(
        recent_ids=0,
        run_ids=FLUSH_AT,
        runs=1,
        run_bytes=RUN_HEADER_SIZE + 16 * FLUSH_AT,
        filter_bytes=2 * MIN_FILTER_IDS,
        filter_ids=FLUSH_AT,
        filter_lookups=0,
        filter_false_positives=0,
    )
    assert [store.find(hashed) for hashed in hashes] == list(range(FLUSH_AT))


def test_a_failed_flush_keeps_its_ids_and_is_planned_again(tmp_path: Path) -> None:
    directory = tmp_path / "orders"
    store = DedupStore.open(directory, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(FLUSH_AT, seed=18)
    for seq, hashed in enumerate(hashes):
        store.add(hashed, seq)
    job = store.plan()
    assert job is not None
    shutil.rmtree(directory)  # the disk fails the write
    with pytest.raises(StorageError, match="flush"):
        job.run()
    assert not store.commit(job)
    assert store.find(hashes[1]) == 1  # still answered from the frozen dict
    directory.mkdir()
    retry = store.plan()
    assert retry is not None
    assert retry.kind == "flush"
    retry.run()
    assert store.commit(retry)
    assert run_files(directory) == ["00000000000000000000-00000000000000001000.run"]
    assert [store.find(hashed) for hashed in hashes] == list(range(FLUSH_AT))


def test_flush_all_finishes_the_outstanding_job(tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    hashes = random_hashes(FLUSH_AT + 10, seed=15)
    for seq, hashed in enumerate(hashes[:FLUSH_AT]):
        store.add(hashed, seq)
    job = store.plan()  # a flush a worker has not run yet
    assert job is not None
    for seq, hashed in enumerate(hashes[FLUSH_AT:], start=FLUSH_AT):
        store.add(hashed, seq)
    store.flush_all()  # runs the planned flush, then flushes the 10 ids after it
    assert not store.commit(job)  # the caller's late commit is a no-op
    job.run()  # and so is its late run
    assert store.covered_end == FLUSH_AT + 10
    assert len(run_files(tmp_path)) == 2
    store.close()
    reopened = DedupStore.open(tmp_path, flush_at=FLUSH_AT, fan_in=FAN_IN)
    assert reopened.problems == []
    assert [reopened.find(hashed) for hashed in hashes] == list(range(FLUSH_AT + 10))


def test_find_many_answers_what_find_answers(filled: Filled) -> None:
    """The vectorised lookup of a produce batch: ids in runs, absent ids, expired ones."""
    store = filled.store
    absent = random_hashes(500, seed=7)
    batch = [h for pair in zip(filled.hashes[::200], absent, strict=False) for h in pair]
    assert store.find_many(batch) == [store.find(h) for h in batch]
    assert store.find_many(batch[:5]) == [store.find(h) for h in batch[:5]]  # below VECTOR_MIN
    assert [s for s in store.find_many(filled.hashes[:3000:3]) if s is None] == []
