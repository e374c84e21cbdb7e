"""``DataDirLock`` and ``probe``: re-entrant within a process, refused across processes,
freed by the kernel when the holder dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qmq_broker.errors import StorageError
from qmq_broker.storage.lock import LOCK_FILE, DataDirLock, DataDirLocked, probe

HOLD = """
import sys, time
from pathlib import Path
from qmq_broker.storage.lock import DataDirLock
with DataDirLock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_missing_directory_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with (
        pytest.raises(StorageError, match="no such file or directory") as failed,
        DataDirLock(missing),
    ):
        pass
    assert str(missing) in str(failed.value)
    assert not isinstance(failed.value, DataDirLocked)


def test_probe_sees_no_holder_in_a_fresh_directory_or_its_own_lock(tmp_path: Path) -> None:
    assert probe(tmp_path) is None
    with DataDirLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().strip().isdigit()
        assert probe(tmp_path) is None  # this process's own lock is not another's
    assert probe(tmp_path) is None


def test_another_process_holds_it_until_it_is_killed(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "held"
        seen = probe(tmp_path)
        assert seen is not None
        assert seen.pid == child.pid
        with pytest.raises(DataDirLocked) as refused, DataDirLock(tmp_path):
            pass
        assert refused.value.pid == child.pid
        assert str(refused.value) == (
            f"data directory {tmp_path} is in use by another process (pid {child.pid})"
        )
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        began = time.monotonic()
        with DataDirLock(tmp_path):
            assert time.monotonic() - began < 0.5  # at once: no stale lock to wait out
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
