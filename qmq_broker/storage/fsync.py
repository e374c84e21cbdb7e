"""Every place the broker forces data to disk: fsync, fdatasync and the file recipes on them.

The journal's group commit calls ``sync_data`` on the log and index descriptors it wrote;
new segment files call ``sync_new_file``; checkpoints use ``replace_keeping_previous``;
route tables ``replace_file``; recovery uses ``truncate_file`` and ``rewrite_file``.
Nothing else in the broker calls ``os.fsync``.
"""

from __future__ import annotations

import os
from pathlib import Path


def sync_data(fd: int) -> None:
    """Force a descriptor's written data (not its metadata, e.g. mtime) to disk."""
    os.fdatasync(fd)


def sync_all(fd: int) -> None:
    """Force a descriptor's data and metadata (its size, after an append) to disk."""
    os.fsync(fd)


def sync_dir(path: Path) -> None:
    """Make a directory's entries (a new or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_new_file(fd: int, path: Path) -> None:
    """A file just created (and headed): its bytes and its name in the directory."""
    os.fsync(fd)
    sync_dir(path.parent)


def replace_keeping_previous(path: Path, previous: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``, the replaced file becoming ``previous``.

    Write a temporary, fsync, rename, rename, fsync the directory. Each rename is atomic;
    a crash between the two leaves ``previous`` and no ``path``, which readers handle by
    taking ``previous``.
    """
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    if path.exists():
        os.replace(path, previous)
    os.replace(tmp, path)
    sync_dir(path.parent)


def replace_file(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``: a temporary, fsync, rename, fsync the
    directory (a crash leaves the old file or the new one, never a mix)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


def rewrite_file(path: Path, *parts: bytes | bytearray) -> None:
    """Write ``path`` anew from ``parts`` and fsync it (recovery's rebuilt indexes)."""
    with open(path, "wb") as handle:
        for part in parts:
            handle.write(part)
        handle.flush()
        os.fsync(handle.fileno())


def truncate_file(path: Path, size: int) -> None:
    """Cut a file to ``size`` bytes (a torn tail) and fsync it."""
    with open(path, "r+b") as handle:
        handle.truncate(size)
        os.fsync(handle.fileno())
