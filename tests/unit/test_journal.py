"""The journal's hand-off to its writer thread: group commit, order, failure, close, and
which batches the loop writes itself.

A real journal on a real data dir; fsyncs are counted through its ``on_fsync`` hook.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from qmq_broker.config import FsyncPolicy
from qmq_broker.errors import StorageError
from qmq_broker.format import HEADER_SIZE, SegmentKind
from qmq_broker.format.files import segment_header
from qmq_broker.format.frames import frame
from qmq_broker.format.index import INDEX_ENTRY
from qmq_broker.storage.journal import INLINE_BYTES, INLINE_FSYNC_S, Journal


def journal(
    data_dir: Path, fsyncs: list[float], *, messages_end: int = HEADER_SIZE,
    actions_end: int = HEADER_SIZE, ack_fsync: str = "always",
) -> Journal:  # fmt: skip
    """A journal of 1 MiB segments whose logs' data end at the given offsets of segment 0,
    under ``--fsync always``."""
    return Journal(
        data_dir=data_dir,
        fsync=FsyncPolicy(mode="always"),
        ack_fsync=FsyncPolicy(mode=ack_fsync),
        segment_bytes=1 << 20,
        messages_at=(0, messages_end),
        actions_at=(0, actions_end),
        on_fsync=fsyncs.append,
    )


def actions_written(data_dir: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted((data_dir / "actions").iterdir()))


def test_appends_of_one_loop_turn_share_one_write_and_fsync(tmp_path: Path) -> None:
    fsyncs: list[float] = []

    async def main() -> None:
        j = journal(tmp_path, fsyncs)
        j.start()
        points = []
        for n in range(5):  # five requests answered in the same turn of the loop
            j.append_action(f"action {n}".encode())
            points.append(j.commit_point())
        await asyncio.gather(*points)
        assert len(fsyncs) == 1
        written = actions_written(tmp_path)
        assert all(f"action {n}".encode() in written for n in range(5))
        await j.close()

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_others_of_its_batch_waiting_for_the_write(
    tmp_path: Path,
) -> None:
    """A task waiting for a commit point and cancelled (a shutdown cancels the loops) cancels
    its own future only: the others of the batch, and a checkpoint's job asked for after,
    still resolve once the batch is written."""
    fsyncs: list[float] = []

    async def main() -> None:
        j = journal(tmp_path, fsyncs)
        j.start()
        j.append_action(b"a")
        waiting = asyncio.create_task(asyncio.wait_for(j.commit_point(), 10))
        cancelled = asyncio.create_task(asyncio.wait_for(j.commit_point(), 10))
        await asyncio.sleep(0)  # both wait on the batch
        cancelled.cancel()
        jobs: list[str] = []
        after = j.run_after_flush(lambda: jobs.append("checkpoint"))
        await waiting
        await after
        assert jobs == ["checkpoint"]
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert b"a" in actions_written(tmp_path)
        await j.close()

    asyncio.run(main())


def test_what_gathers_while_a_batch_is_written_goes_next_in_order(tmp_path: Path) -> None:
    fsyncs: list[float] = []
    order: list[str] = []

    async def main() -> None:
        j = journal(tmp_path, fsyncs)
        j.start()
        release = threading.Event()

        def hold() -> None:  # holds the writer thread until released
            release.wait()

        first = j.run_after_flush(hold)
        first.add_done_callback(lambda _: order.append("first"))
        await asyncio.sleep(0.05)  # the first batch is with the writer now
        j.append_action(b"second")
        second = j.commit_point()
        second.add_done_callback(lambda _: order.append("second"))
        nothing = j.commit_point()  # asks for what was appended so far: the same batch
        nothing.add_done_callback(lambda _: order.append("same batch"))
        await asyncio.sleep(0.05)
        assert not second.done(), "the next batch waits for the one being written"
        assert not nothing.done()
        release.set()
        await asyncio.gather(first, second, nothing)
        assert order == ["first", "second", "same batch"]
        assert b"second" in actions_written(tmp_path)
        empty = j.commit_point()  # nothing appended and nothing in flight: at once
        await asyncio.wait_for(empty, 1)
        await j.close()

    asyncio.run(main())


@pytest.mark.parametrize("big", [False, True], ids=["on-loop", "on-thread"])
def test_a_failed_write_fails_its_batch_and_makes_the_journal_read_only(
    tmp_path: Path, big: bool
) -> None:
    fsyncs: list[float] = []

    async def main() -> None:
        j = journal(tmp_path, fsyncs)
        j.start()
        append_message(j, 0)
        await j.commit_point()
        # the next segment cannot be opened: its directory is now a file
        shutil.rmtree(tmp_path / "messages")
        (tmp_path / "messages").write_bytes(b"not a directory")
        j.messages.segment, j.messages.end_offset = 1, HEADER_SIZE  # the next append rolls
        append_message(j, 1, size=INLINE_BYTES if big else 100)
        failing = j.commit_point()
        with pytest.raises(StorageError, match="write failed"):
            await failing
        assert j.failed is not None
        with pytest.raises(StorageError, match="read-only"):
            j.commit_point()
        await asyncio.wait_for(j.close(), 5)  # the writer thread still stops

    asyncio.run(main())


def writers_of(j: Journal) -> list[str]:
    """The names of the threads that write ``j``'s log frames, in order, from now on."""
    names: list[str] = []
    files = j._files
    write_log = files.write_log

    def spied(*args: Any) -> None:
        names.append(threading.current_thread().name)
        write_log(*args)

    files.write_log = spied  # type: ignore[method-assign,assignment]
    return names


def started_and_spied(
    data_dir: Path, fsyncs: list[float], *, ack_fsync: str = "always"
) -> tuple[Journal, list[str]]:
    """A started ``journal`` (on the running loop) and ``writers_of`` it."""
    j = journal(data_dir, fsyncs, ack_fsync=ack_fsync)
    j.start()
    return j, writers_of(j)


def append_message(j: Journal, seq: int, size: int = 100) -> None:
    j.append_messages(
        [frame(b"m" * size)], subject="s", first_seq=seq, stored_at_us=1, hashed_ids=[seq]
    )


def test_a_small_batch_of_messages_is_written_on_the_loop_others_by_the_writer_thread(
    tmp_path: Path,
) -> None:
    fsyncs: list[float] = []

    async def main() -> None:
        j, writers = started_and_spied(tmp_path, fsyncs)
        loop_thread = threading.current_thread().name
        append_message(j, 0)  # a single produce
        await j.commit_point()
        append_message(j, 1, size=INLINE_BYTES)  # a big one
        await j.commit_point()
        append_message(j, 2)
        await j.run_after_flush(lambda: None)  # jobs (checkpoints, dedup runs) may be slow
        j.append_action(b"a lease")  # pulls' actions: see the next test
        await j.commit_point()
        assert writers == [loop_thread, *["qmq-journal-writer"] * 3]
        assert len(fsyncs) == 4  # each durable before its future resolved, on either side
        assert b"a lease" in actions_written(tmp_path)
        await j.close()

    asyncio.run(main())


def test_actions_to_fsync_go_to_the_writer_thread_unless_relaxed(tmp_path: Path) -> None:
    """A loop blocked in the fsync of pulls' leases and acks is time the fair scheduler
    charges no group for; relaxed ones (``--ack-fsync never``) are only written."""
    fsyncs: list[float] = []

    async def main() -> None:
        j, writers = started_and_spied(tmp_path, fsyncs, ack_fsync="never")
        j.append_action(b"an ack", relaxed=True)
        await j.commit_point()
        j.append_action(b"a dead-lettering")  # never relaxed
        await j.commit_point()
        assert writers == [threading.current_thread().name, "qmq-journal-writer"]
        assert len(fsyncs) == 1  # the relaxed one was written, not fsynced
        await j.close()

    asyncio.run(main())


def test_while_fsyncs_are_slow_even_small_batches_go_to_the_writer_thread(
    tmp_path: Path,
) -> None:
    fsyncs: list[float] = []

    async def main() -> None:
        j, writers = started_and_spied(tmp_path, fsyncs)
        append_message(j, 0)
        await j.commit_point()
        assert 0 < j.fsync_average_s < INLINE_FSYNC_S  # this disk: quick
        j.fsync_average_s = 10 * INLINE_FSYNC_S  # as a slow disk's fsyncs would make it
        append_message(j, 1)
        await j.commit_point()
        assert writers == [threading.current_thread().name, "qmq-journal-writer"]
        assert j.fsync_average_s < 10 * INLINE_FSYNC_S  # measured fsyncs move it back
        await j.close()

    asyncio.run(main())


def test_close_writes_what_is_pending_and_stops_the_writer_thread(tmp_path: Path) -> None:
    fsyncs: list[float] = []

    async def main() -> None:
        before = set(threading.enumerate())
        j = journal(tmp_path, fsyncs)
        j.start()
        (writer,) = set(threading.enumerate()) - before
        assert writer.name == "qmq-journal-writer"
        j.append_action(b"pending at close")
        await j.close()
        assert not writer.is_alive()
        assert b"pending at close" in actions_written(tmp_path)
        with pytest.raises(StorageError, match="closed"):
            j.commit_point()

    asyncio.run(main())


def test_a_log_segment_is_allocated_ahead_and_cut_to_its_data_on_roll_and_close(
    tmp_path: Path,
) -> None:
    fsyncs: list[float] = []
    segment_bytes = 1 << 20

    async def main() -> None:
        j = journal(tmp_path, fsyncs)  # segments of 1 MiB
        j.start()
        j.append_action(b"first")
        await j.commit_point()
        first = tmp_path / "actions" / "00000000000000000000.seg"
        assert first.stat().st_size == segment_bytes  # room up to the segment's size
        end = j.actions.end_offset
        j.actions.segment, j.actions.end_offset = 1, HEADER_SIZE  # the next append rolls
        j.append_action(b"second")
        await j.commit_point()
        assert first.stat().st_size == end  # rolling cut its room off
        second = tmp_path / "actions" / "00000000000000000001.seg"
        assert second.stat().st_size == segment_bytes
        second_end = j.actions.end_offset
        await j.close()
        assert second.stat().st_size == second_end  # and so did closing

    asyncio.run(main())


def first_actions_segment(data_dir: Path) -> Path:
    return data_dir / "actions" / "00000000000000000000.seg"


def crashed_with_room(data_dir: Path) -> int:
    """One action appended, then the segment as a kill -9 would leave it (room included);
    returns where its data ends."""
    segment = first_actions_segment(data_dir)

    async def crashed() -> int:
        j = journal(data_dir, [])
        j.start()
        j.append_action(b"kept")
        await j.commit_point()
        as_killed = segment.read_bytes()
        await j.close()
        segment.write_bytes(as_killed)
        return j.actions.end_offset

    return asyncio.run(crashed())


def test_room_left_by_a_crash_is_cut_at_close_even_with_nothing_written(tmp_path: Path) -> None:
    segment = first_actions_segment(tmp_path)
    end = crashed_with_room(tmp_path)
    assert segment.stat().st_size > end

    async def restarted() -> None:
        j = journal(tmp_path, [], actions_end=end)  # where recovery found the end
        j.start()
        await j.close()

    asyncio.run(restarted())
    assert segment.stat().st_size == end
    assert b"kept" in segment.read_bytes()


@pytest.mark.parametrize("start", [HEADER_SIZE, (1 << 20) - 3000], ids=["fits", "rolls"])
def test_a_requests_frames_land_where_their_index_entries_say(tmp_path: Path, start: int) -> None:
    """One run when they fit in the segment, placed frame by frame when it rolls part way."""
    frames = [frame(bytes([n]) * 1000) for n in range(5)]

    async def main() -> list[bytes]:
        j = journal(tmp_path, [], messages_end=start)
        j.start()
        if start > HEADER_SIZE:  # a segment whose data ends there
            (tmp_path / "messages" / "00000000000000000000.seg").write_bytes(
                segment_header(SegmentKind.MESSAGES) + bytes(start - HEADER_SIZE)
            )
        entries = j.append_messages(
            frames, subject="s", first_seq=0, stored_at_us=1, hashed_ids=list(range(5))
        )
        await j.commit_point()
        await j.close()
        return entries

    entries = asyncio.run(main())
    segments = set()
    for framed, entry in zip(frames, entries, strict=True):
        segment, length, offset, stored_at_us, _ = INDEX_ENTRY.unpack(entry)
        segments.add(segment)
        data = (tmp_path / "messages" / f"{segment:020d}.seg").read_bytes()
        assert data[offset : offset + length] == framed
        assert stored_at_us == 1
    assert segments == ({0} if start == HEADER_SIZE else {0, 1})


def test_room_left_by_a_crash_is_cut_when_the_first_append_rolls(tmp_path: Path) -> None:
    segment = first_actions_segment(tmp_path)
    end = crashed_with_room(tmp_path)

    async def restarted() -> None:
        j = journal(tmp_path, [], actions_end=end)
        j.start()
        j.append_action(b"x" * (1 << 20))  # does not fit after ``end``: goes to segment 1
        await j.commit_point()
        assert segment.stat().st_size == end
        await j.close()

    asyncio.run(restarted())
    assert (tmp_path / "actions" / "00000000000000000001.seg").exists()
