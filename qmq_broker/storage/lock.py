"""One owner per data directory: an exclusive ``flock`` on ``DIR/LOCK``.

The kernel drops the lock when its holder's last descriptor closes, so a ``kill -9`` frees
it at once and no stale file needs cleaning up. The holder writes its pid into the file, for
the message another process gets. Within one process the lock is re-entrant: recovery's
format migration and ``repair`` take it again under the broker's or ``verify``'s own.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
from pathlib import Path

from qmq_broker.errors import StorageError

LOCK_FILE = "LOCK"  # at the top of a data directory, beside FORMAT


class DataDirLocked(StorageError):
    """Another process holds the data directory."""

    def __init__(self, *, data_dir: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(f"data directory {data_dir} is in use by another process ({holder})")
        self.data_dir = data_dir
        self.pid = pid


@dataclasses.dataclass(slots=True)
class _Held:
    fd: int
    depth: int


# Locks this process holds, by the lock file's real path: flock conflicts between two
# descriptors of one process too, so a nested take must reuse the first one's.
_held: dict[str, _Held] = {}
_guard = threading.Lock()


class DataDirLock:
    """Hold ``data_dir`` exclusively while in the ``with`` block; ``DataDirLocked`` when
    another process holds it, ``StorageError`` when the lock file cannot be opened."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._key = os.path.realpath(data_dir / LOCK_FILE)

    def __enter__(self) -> DataDirLock:
        with _guard:
            held = _held.get(self._key)
            if held is not None:
                held.depth += 1
                return self
            _held[self._key] = _Held(fd=self._take(), depth=1)
        return self

    def __exit__(self, *exc: object) -> None:
        with _guard:
            held = _held[self._key]
            held.depth -= 1
            if held.depth:
                return
            del _held[self._key]
            try:
                os.ftruncate(held.fd, 0)  # no pid left behind to mislead the next reader
            finally:
                os.close(held.fd)  # closing the last descriptor releases the flock

    def _take(self) -> int:
        try:
            fd = os.open(self._key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._failed(exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BlockingIOError:  # from flock: another process holds it
            pid = _read_pid(fd)
            os.close(fd)
            raise DataDirLocked(data_dir=self.data_dir, pid=pid) from None
        except OSError as exc:
            os.close(fd)
            raise self._failed(exc) from exc
        return fd

    def _failed(self, exc: OSError) -> StorageError:
        text = os.strerror(exc.errno) if exc.errno else str(exc)
        return StorageError(f"cannot lock data directory {self.data_dir}: {text.lower()}")


def probe(data_dir: Path) -> DataDirLocked | None:
    """What taking ``data_dir`` would raise because another process holds it; None when no
    other process does. Writes nothing, so it works on a read-only copy."""
    key = os.path.realpath(data_dir / LOCK_FILE)
    with _guard:
        if key in _held:
            return None
        try:
            fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # none (never locked), or no read access: the check reads on
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return DataDirLocked(data_dir=data_dir, pid=_read_pid(fd))
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None
