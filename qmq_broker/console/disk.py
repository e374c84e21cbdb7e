"""How much disk the data directory takes, and how much its file system has left."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DiskUse:
    data_bytes: int
    """Allocated to the data directory's files (blocks, so sparse and preallocated files
    count as what they take)."""
    free_bytes: int
    total_bytes: int


def disk_use(data_dir: Path) -> DiskUse:
    """Walk ``data_dir`` (blocking: run it on a thread). Files that vanish meanwhile, as
    retention deletes them, are left out rather than failing the walk."""
    used = 0
    pending = [str(data_dir)]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                continue
    usage = shutil.disk_usage(data_dir)
    return DiskUse(data_bytes=used, free_bytes=usage.free, total_bytes=usage.total)
