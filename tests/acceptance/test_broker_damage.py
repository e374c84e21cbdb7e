"""A broker whose recovery fails exits non-zero with one line: it never listens while failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qmq_broker.format import SegmentKind
from qmq_broker.format.files import segment_header
from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from tests.support.broker_process import BrokerProcess, free_port


def start_broker(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "qmq_outbox",
            "broker",
            "--data-dir",
            str(data_dir),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("messages/00000000000000000000.seg", segment_header(SegmentKind.ACTIONS)),
        ("messages/00000000000000000000.seg", b"NOTASEGMENTHEADER-and-then-some-bytes"),
    ],
    ids=["segment of another kind", "segment header unreadable"],
)
def test_a_failed_recovery_exits_1_with_one_line(tmp_path: Path, name: str, content: bytes) -> None:
    data_dir = tmp_path / "data"
    (data_dir / "messages").mkdir(parents=True)
    (data_dir / name).write_bytes(content)
    done = start_broker(data_dir)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"qmq broker: recovery of {data_dir} failed: ")
    assert name.rsplit("/", 1)[-1] in last


def test_a_missing_middle_segment_exits_1_unless_skipped(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    broker = BrokerProcess(data_dir, extra_args=["--segment-size", "1048576"]).start()
    try:
        with BrokerClient(broker.url) as client:
            body = b"x" * 4000
            for start in range(0, 1000, 100):
                messages = [
                    OutgoingMessage(id=f"m-{i}", subject="orders", body=body)
                    for i in range(start, start + 100)
                ]
                client.produce(messages)
    finally:
        broker.terminate()
    segments = sorted((data_dir / "messages").glob("*.seg"))
    assert len(segments) >= 3
    segments[1].unlink()

    done = start_broker(data_dir)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "missing between others" in last
    assert "--on-damage skip" in last

    skipping = BrokerProcess(data_dir, extra_args=["--on-damage", "skip"]).start()
    try:
        with BrokerClient(skipping.url) as client:
            stats = client.subject("orders")
        assert stats["next_seq"] == 1000
    finally:
        skipping.stop()
