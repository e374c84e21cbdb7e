"""Stage progress: plain lines for logs and pipes, timings either way (pure, no Spark)."""

from __future__ import annotations

import io

import pytest

from qmq_reconcile.progress import PlainProgress, for_stream, stage


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool | None]] = []

    def started(self, stage: str, label: str) -> None:
        self.events.append(("started", stage, None))

    def finished(self, stage: str, seconds: float, *, ok: bool) -> None:
        self.events.append(("finished", stage, ok))


def test_plain_lines_say_each_stage_and_its_time_when_it_ends() -> None:
    out = io.StringIO()
    progress = PlainProgress(out)
    progress.started("read_broker", "reading broker data")
    progress.started("read_outbox", "reading outbox tables")
    assert out.getvalue() == ""  # side-by-side stages cannot share a growing line
    progress.finished("read_outbox", 1.25, ok=True)
    progress.finished("read_broker", 3.14, ok=False)
    assert out.getvalue().splitlines() == [
        "reconcile: reading outbox tables ... 1.2 s",
        "reconcile: reading broker data ... failed after 3.1 s",
    ]


def test_stage_times_into_the_timings_and_tells_the_progress() -> None:
    timings: dict[str, float] = {}
    recorder = Recorder()
    with stage(recorder, timings, "classify", "classifying messages"):
        pass
    with pytest.raises(RuntimeError), stage(recorder, timings, "groups", "counting"):
        raise RuntimeError("boom")
    with stage(None, timings, "write_outputs", "writing"):
        pass
    assert set(timings) == {"classify", "groups", "write_outputs"}
    assert all(seconds >= 0 for seconds in timings.values())
    assert recorder.events == [
        ("started", "classify", None),
        ("finished", "classify", True),
        ("started", "groups", None),
        ("finished", "groups", False),
    ]


def test_a_stream_that_is_not_a_terminal_gets_plain_lines() -> None:
    out = io.StringIO()
    with for_stream(out) as progress:
        assert isinstance(progress, PlainProgress)
        progress.started("start_spark", "starting Spark (local[2])")
        progress.finished("start_spark", 4.0, ok=True)
    assert out.getvalue() == "reconcile: starting Spark (local[2]) ... 4.0 s\n"
