"""`qmq broker verify`: each kind of damage is named with its file and offset, and exit codes.

A real broker writes one data directory (three message segments, an action log with acks,
both checkpoints); each test damages a copy by hand and runs the command in a subprocess.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qmq_broker.format import SegmentKind, iter_frames, list_segments
from qmq_broker.format.frames import FRAME_SIZE
from qmq_broker.format.index import INDEX_ENTRY_SIZE, INDEX_HEADER, index_chunk_path
from qmq_broker.storage.checkpoint import CHECKPOINT_FILE
from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from tests.support.broker_process import BrokerProcess

SUBJECTS = ("verify.a", "verify.b")
BODY = b"v" * 60_000  # 1 MiB segments: about 17 messages each
PER_SUBJECT = 25


def qmq_verify(data_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "qmq_outbox",
            "broker",
            "verify",
            "--data-dir",
            str(data_dir),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory a real broker wrote and shut down cleanly."""
    data_dir = tmp_path_factory.mktemp("verify") / "data"
    broker = BrokerProcess(
        data_dir, extra_args=["--segment-size", "1048576", "--checkpoint-interval", "100ms"]
    ).start()
    try:
        with BrokerClient(broker.url, timeout=10) as client:
            for n in range(PER_SUBJECT):
                client.produce(
                    [OutgoingMessage(id=f"{s}-{n}", subject=s, body=BODY) for s in SUBJECTS]
                )
            pulled = client.pull(SUBJECTS[0], "auditors", "c1", max_messages=10)
            client.ack(SUBJECTS[0], "auditors", "c1", [m.seq for m in pulled])
        time.sleep(0.5)  # a few checkpoints, so the previous one exists too
        assert broker.terminate() == 0
    finally:
        broker.stop()
    assert len(list_segments(data_dir, SegmentKind.MESSAGES)) >= 3
    assert (data_dir / "checkpoint.prev.json").exists()
    return data_dir


@pytest.fixture
def data_dir(written: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(written, copy)
    return copy


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def second_frame(path: Path) -> int:
    """Offset of a frame's payload byte in the middle of a segment (valid frames follow)."""
    frames = list(iter_frames(path.read_bytes(), path=str(path)))
    assert len(frames) >= 3
    return frames[1][0]


def assert_damage_named(done: subprocess.CompletedProcess[str], path: Path, offset: int) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{path} at {offset}: " in done.stdout, done.stdout
    assert "damaged" in done.stdout.splitlines()[-1]


def test_a_clean_directory_exits_0_and_verify_writes_nothing(data_dir: Path) -> None:
    before = {p: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()}
    done = qmq_verify(data_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [done.stdout.splitlines()[-1]]
    assert "clean" in done.stdout
    assert {p: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("which", [0, -1], ids=["non-last segment", "last segment"])
def test_a_flipped_bit_in_a_message_segment_is_named(data_dir: Path, which: int) -> None:
    segment = list_segments(data_dir, SegmentKind.MESSAGES)[which]
    at = second_frame(segment)
    flip_bit(segment, at + FRAME_SIZE + 100)
    done = qmq_verify(data_dir)
    assert_damage_named(done, segment, at)
    assert "1 messages unreadable" in done.stdout


def test_a_flipped_bit_in_an_action_segment_is_named(data_dir: Path) -> None:
    segment = list_segments(data_dir, SegmentKind.ACTIONS)[0]
    at = second_frame(segment)
    flip_bit(segment, at + FRAME_SIZE + 2)
    done = qmq_verify(data_dir)
    assert_damage_named(done, segment, at)
    assert "redelivery" in done.stdout


def test_a_flipped_bit_in_an_index_entry_is_repaired(data_dir: Path) -> None:
    index = index_chunk_path(data_dir, SUBJECTS[1], 0)
    entry = INDEX_HEADER.size + 3 * INDEX_ENTRY_SIZE
    flip_bit(index, entry + 24)  # the id hash
    segments = {p: p.read_bytes() for p in data_dir.glob("messages/*.seg")}
    done = qmq_verify(data_dir)
    assert_damage_named(done, index, entry)
    assert "seq 3" in done.stdout
    assert "--repair" in done.stdout

    repaired = qmq_verify(data_dir, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert f"repaired: rewrote {index}" in repaired.stdout
    assert qmq_verify(data_dir).returncode == 0
    assert {p: p.read_bytes() for p in data_dir.glob("messages/*.seg")} == segments


def test_a_damaged_checkpoint_is_repaired(data_dir: Path) -> None:
    checkpoint = data_dir / CHECKPOINT_FILE
    flip_bit(checkpoint, checkpoint.read_bytes().index(b"messages_at") + 14)
    done = qmq_verify(data_dir)
    assert_damage_named(done, checkpoint, 0)
    assert "checkpoint does not check out" in done.stdout

    repaired = qmq_verify(data_dir, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "repaired: wrote" in repaired.stdout
    assert qmq_verify(data_dir).returncode == 0


def test_a_missing_middle_segment_is_named(data_dir: Path) -> None:
    middle = list_segments(data_dir, SegmentKind.MESSAGES)[1]
    middle.unlink()
    done = qmq_verify(data_dir)
    assert_damage_named(done, middle, 0)
    assert "segment missing" in done.stdout
    assert "messages unreadable" in done.stdout


def test_a_header_that_is_not_ours_is_named(data_dir: Path) -> None:
    segment = list_segments(data_dir, SegmentKind.MESSAGES)[0]
    flip_bit(segment, 0)
    assert_damage_named(qmq_verify(data_dir), segment, 0)


def test_a_missing_data_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    done = qmq_verify(tmp_path / "nowhere")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "nowhere" in lines[0]
    assert done.stdout == ""


def test_a_damaged_dedup_run_is_named_removed_by_repair_and_refilled_from_the_index(
    data_dir: Path,
) -> None:
    (run,) = sorted((data_dir / "dedup" / SUBJECTS[0]).glob("*.run"))  # written at shutdown
    flip_bit(run, run.stat().st_size - 3)  # in the seqs column
    done = qmq_verify(data_dir)
    assert done.returncode != 0
    assert str(run) in done.stdout
    assert "seqs CRC mismatch" in done.stdout

    repaired = qmq_verify(data_dir, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert f"removed {run}" in repaired.stdout
    assert qmq_verify(data_dir).returncode == 0
    broker = BrokerProcess(data_dir).start()
    try:
        with BrokerClient(broker.url, timeout=10) as client:
            again = client.produce(
                [
                    OutgoingMessage(id=f"{SUBJECTS[0]}-{n}", subject=SUBJECTS[0], body=BODY)
                    for n in (0, 24)
                ]
            )
        assert [(a.status, a.seq) for a in again] == [("duplicate", 0), ("duplicate", 24)]
    finally:
        broker.stop()
