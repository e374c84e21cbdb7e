"""How fast this box runs Python right now: the same machine has been seen 2-3 times slower
on some days (a shared host), and every absolute figure moves with it. Benchmarks print
this beside the load average, so figures from different days can be told apart.

Two figures, because they do not move together: a plain loop of additions (the CPU core)
and building, encoding and decoding 200,000 small dicts (allocation and memory, where a
busy host shows first: on 2026-11-23 the loop ran at its usual speed while the broker's
CPU per message was twice another day's)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

LOOP = 10_000_000
ROWS = 200_000


def python_speed() -> str:
    """``python: loop 0.45 s, objects 0.80 s``: the best of three runs of each (lower is
    faster)."""
    loop = min(_timed(_loop) for _ in range(3))
    objects = min(_timed(_objects) for _ in range(3))
    return f"python: loop {loop:.2f} s, objects {objects:.2f} s"


def _timed(work: Callable[[], None]) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def _loop() -> None:
    total = 0
    for number in range(LOOP):
        total += number


def _objects() -> None:
    rows = [{"id": f"order-{n}", "seq": n, "body": "x" * 100} for n in range(ROWS)]
    json.loads(json.dumps(rows))
