"""The event loop's CPU per request that no handler measures: reading and parsing the
request, routing it through the middleware, writing the answer (uvicorn, Starlette).

A pull's own work is measured where it happens (its decoding and encoding in the handler,
its reads in the scheduler) and charged to its group; this part is not, and with small
pulls it is most of a pull's cost: a group of 100 consumers would buy far more of the loop
than its measured work says. ``LoopOverhead`` estimates it from the loop thread's CPU time
over the last requests, less what was measured, so each pull can be charged it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SAMPLE_REQUESTS = 256  # requests per estimate
SMOOTHING = 0.3  # weight of the newest estimate


class LoopOverhead:
    """``per_request``: the unmeasured loop CPU of one request, recently (seconds).

    Call ``request`` on the loop thread once per HTTP request; ``measured`` returns the
    running total of the work the broker measured itself
    (``Broker.measured_pull_work_s``). Work
    measured off the loop (cold reads on a read thread) makes the estimate low, never
    negative; produces and acks count as requests, and their own unmeasured work joins
    the overhead, the same for every group's pulls.
    """

    def __init__(
        self, measured: Callable[[], float], *, cpu: Callable[[], float] = time.thread_time
    ) -> None:
        self._measured = measured
        self._clock = cpu  # the calling thread's CPU time: call on the loop thread only
        self._requests = 0
        self._since = 0
        self._cpu = cpu()
        self._known = measured()
        self.per_request = 0.0

    def request(self) -> None:
        self._requests += 1
        if self._requests - self._since >= SAMPLE_REQUESTS:
            self._sample()

    def _sample(self) -> None:
        cpu, known = self._clock(), self._measured()
        count = self._requests - self._since
        latest = max(cpu - self._cpu - (known - self._known), 0.0) / count
        first = self._since == 0
        self.per_request = (
            latest if first else (1 - SMOOTHING) * self.per_request + (SMOOTHING * latest)
        )
        self._cpu, self._known, self._since = cpu, known, self._requests
