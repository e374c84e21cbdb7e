"""``--ack-fsync``: which journal batches wait for an fsync under ``--fsync always``.

A real journal on a real data dir; the fsyncs are counted through its ``on_fsync`` hook.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qmq_broker.config import FsyncPolicy
from qmq_broker.format import HEADER_SIZE
from qmq_broker.storage.journal import Journal

ALWAYS = FsyncPolicy(mode="always")


def journal(data_dir: Path, ack_fsync: FsyncPolicy, fsyncs: list[float]) -> Journal:
    return Journal(
        data_dir=data_dir,
        fsync=ALWAYS,
        segment_bytes=1 << 20,
        messages_at=(0, HEADER_SIZE),
        actions_at=(0, HEADER_SIZE),
        on_fsync=fsyncs.append,
        ack_fsync=ack_fsync,
    )


async def appended(j: Journal, *, relaxed: bool) -> None:
    j.append_action(b"an action record", relaxed=relaxed)
    await j.commit_point()


@pytest.mark.parametrize("policy", ["interval:60000", "never"])
def test_relaxed_actions_alone_are_answered_without_an_fsync(tmp_path: Path, policy: str) -> None:
    fsyncs: list[float] = []

    async def main() -> list[int]:
        j = journal(tmp_path, FsyncPolicy.parse(policy), fsyncs)
        j.start()
        counts = []
        await appended(j, relaxed=True)  # a lease, an ack, a nack
        counts.append(len(fsyncs))
        # answered once written: a killed process leaves it to the OS, which keeps it
        assert b"an action record" in written_actions(tmp_path)
        await appended(j, relaxed=False)  # anything else: the batch is fsynced
        counts.append(len(fsyncs))
        await j.close()
        return counts

    assert asyncio.run(main()) == [0, 1]


def written_actions(data_dir: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted((data_dir / "actions").iterdir()))


def test_under_always_every_batch_is_fsynced(tmp_path: Path) -> None:
    fsyncs: list[float] = []

    async def main() -> int:
        j = journal(tmp_path, ALWAYS, fsyncs)
        j.start()
        await appended(j, relaxed=True)
        await appended(j, relaxed=True)
        count = len(fsyncs)
        await j.close()
        return count

    assert asyncio.run(main()) == 2


def test_the_ack_timer_fsyncs_what_relaxed_actions_wrote(tmp_path: Path) -> None:
    fsyncs: list[float] = []

    async def main() -> list[int]:
        j = journal(tmp_path, FsyncPolicy.parse("interval:20"), fsyncs)
        j.start()
        await appended(j, relaxed=True)
        counts = [len(fsyncs)]
        await asyncio.sleep(0.2)  # ten periods: one fsync for the written ack, none idle
        counts.append(len(fsyncs))
        await j.close()
        return counts

    assert asyncio.run(main()) == [0, 1]
