"""The estimate of the event loop's unmeasured CPU per request (``qmq_broker.http.overhead``)."""

from __future__ import annotations

import pytest

from qmq_broker.http.overhead import SAMPLE_REQUESTS, SMOOTHING, LoopOverhead


class Meter:
    def __init__(self) -> None:
        self.cpu = 10.0
        self.measured = 2.0


def test_the_overhead_is_the_loops_cpu_less_what_was_measured_per_request() -> None:
    meter = Meter()
    overhead = LoopOverhead(lambda: meter.measured, cpu=lambda: meter.cpu)
    assert overhead.per_request == 0.0  # nothing known yet: nothing extra charged
    for _ in range(SAMPLE_REQUESTS - 1):
        overhead.request()
    meter.cpu += 0.100  # 100 ms of loop CPU, 36 ms of it measured by the handlers
    meter.measured += 0.036
    overhead.request()
    assert overhead.per_request == pytest.approx(0.064 / SAMPLE_REQUESTS)
    first = overhead.per_request
    meter.cpu += 0.050  # the next requests are cheaper: the estimate moves toward them
    meter.measured += 0.050 - 0.032
    for _ in range(SAMPLE_REQUESTS):
        overhead.request()
    latest = 0.032 / SAMPLE_REQUESTS
    assert overhead.per_request == pytest.approx((1 - SMOOTHING) * first + SMOOTHING * latest)


def test_work_measured_off_the_loop_never_makes_the_overhead_negative() -> None:
    meter = Meter()
    overhead = LoopOverhead(lambda: meter.measured, cpu=lambda: meter.cpu)
    meter.cpu += 0.010
    meter.measured += 0.500  # cold reads on a read thread
    for _ in range(SAMPLE_REQUESTS):
        overhead.request()
    assert overhead.per_request == 0.0
