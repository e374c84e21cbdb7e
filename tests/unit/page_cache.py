"""Evicting files from the page cache for tests of what is read where, and checking that
it happened: the kernel may keep a page it was advised to drop."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path


def resident_pages(path: Path) -> int:
    """How many of a file's pages are in the page cache (``mincore``; no read, no readahead)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vector = (ctypes.c_ubyte * pages)()
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(page & 1 for page in vector)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def evict(*roots: Path) -> None:
    """Drop files from the page cache (written back first: only clean pages go): each root
    is a file, or a directory whose files all go.

    ``POSIX_FADV_DONTNEED`` is advice: a page still on a CPU's LRU batch, or under
    writeback, stays. So it is repeated until ``mincore`` sees none of the files' pages."""
    files = [
        path
        for root in roots
        for path in ([root] if root.is_file() else root.rglob("*"))
        if path.is_file()
    ]
    for _ in range(200):
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if sum(resident_pages(path) for path in files) == 0:
            return
        time.sleep(0.01)
    cached = {str(path): resident_pages(path) for path in files if resident_pages(path)}
    raise AssertionError(f"the kernel kept these pages cached: {cached}")


def evicted_and_missed(
    path: Path, cached_read: Callable[[], object], miss: type[Exception]
) -> None:
    """Evict ``path`` until ``cached_read`` misses it (raises ``miss``). A virtual disk
    backed by the host's cache can fill an evicted page within a cached-only read
    (``RWF_NOWAIT`` starts the read-ahead, and it may complete before the check), so
    one such read may find it: the eviction is repeated until one does not."""
    for _ in range(50):
        evict(path)
        try:
            cached_read()
        except miss:
            return
    raise AssertionError(f"every cached-only read found {path}'s evicted pages")
