"""Wall time, this process's CPU and the servers' CPU over one measured stretch."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from types import TracebackType

import psutil

# (pid, create time) -> user + system CPU seconds; the create time tells a reused pid apart
CpuSnapshot = dict[tuple[int, float], float]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
    seconds: float
    client_cpu: float  # this process (the clients), seconds
    server_cpu: float  # the server processes, seconds; approximate (see Window)


def cpu_snapshot(processes: list[psutil.Process]) -> CpuSnapshot:
    snapshot: CpuSnapshot = {}
    for process in processes:
        try:
            with process.oneshot():
                times = process.cpu_times()
                snapshot[(process.pid, process.create_time())] = times.user + times.system
        except psutil.Error:  # gone between the listing and the read
            continue
    return snapshot


def cpu_spent(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """CPU used between two snapshots: a process born in between counts whole; one that
    ended in between is lost (the workloads keep their connections open until the end)."""
    return sum(cpu - before.get(key, 0.0) for key, cpu in after.items())


class Window:
    """Measures from ``with`` until ``stop()`` (or the block's end, if not stopped earlier).

    Server CPU is read from /proc through psutil for the processes ``servers`` lists at
    each end, so it is approximate: it includes whatever else those processes did meanwhile.
    """

    def __init__(self, servers: Callable[[], list[psutil.Process]]) -> None:
        self._servers = servers
        self._server0: CpuSnapshot = {}
        self._client0 = self._wall0 = 0.0
        self._cost: Cost | None = None

    def __enter__(self) -> Window:
        self._server0 = cpu_snapshot(self._servers())
        self._client0 = time.process_time()
        self._wall0 = time.perf_counter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self._cost is not None:
            return
        seconds = time.perf_counter() - self._wall0
        client = time.process_time() - self._client0
        server = cpu_spent(self._server0, cpu_snapshot(self._servers()))
        self._cost = Cost(seconds=seconds, client_cpu=client, server_cpu=server)

    @property
    def cost(self) -> Cost:
        if self._cost is None:
            raise RuntimeError("the window is still open")
        return self._cost
