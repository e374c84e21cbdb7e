"""Showing a run's stages as they go: a live ``rich`` display on a terminal, plain lines
elsewhere (``reconcile: reading broker data ... 3.1 s``).

``run`` (``qmq_reconcile.job``) calls a ``Progress`` at the start and end of each stage;
``for_stream`` picks the display for a stream and owns its lifetime. ``rich`` is imported
only for a terminal, and plain lines are shown there too when it is not installed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress as RichDisplay
    from rich.progress import TaskID

PREFIX = "reconcile"


class Progress(Protocol):
    """Told when each stage of a run starts and ends."""

    def started(self, stage: str, label: str) -> None:
        """``stage`` (a ``job.STAGES`` name) began; ``label`` says it in words."""

    def finished(self, stage: str, seconds: float, *, ok: bool) -> None:
        """``stage`` ended after ``seconds``; ``ok`` is false when it raised."""


class PlainProgress:
    """One line per stage when it ends, ``reconcile: <label> ... 3.1 s`` (or ``... failed
    after 3.1 s``): stages that run side by side cannot share a growing line."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()

    def started(self, stage: str, label: str) -> None:
        self._labels[stage] = label

    def finished(self, stage: str, seconds: float, *, ok: bool) -> None:
        outcome = f"{seconds:.1f} s" if ok else f"failed after {seconds:.1f} s"
        with self._lock:
            self._stream.write(f"{PREFIX}: {self._labels[stage]} ... {outcome}\n")
            self._stream.flush()


class LiveProgress:
    """A ``rich`` display: one line per stage, with a spinner while it runs."""

    def __init__(self, display: RichDisplay) -> None:
        self._display = display
        self._tasks: dict[str, TaskID] = {}

    def started(self, stage: str, label: str) -> None:
        self._tasks[stage] = self._display.add_task(label, total=1)

    def finished(self, stage: str, seconds: float, *, ok: bool) -> None:
        task = self._tasks[stage]
        if not ok:
            label = self._display.tasks[task].description
            self._display.update(task, description=f"{label} [red]failed[/red]")
        self._display.update(task, completed=1)
        self._display.stop_task(task)


@contextlib.contextmanager
def for_stream(stream: TextIO) -> Iterator[Progress]:
    """A live display when ``stream`` is a terminal, plain lines otherwise; a live display
    is taken down when the block ends (before anything else is printed).

    The live display writes to its own duplicate of the terminal's descriptor: starting the
    JVM points descriptor 2 at ``spark.log`` for a moment (``session.build_session``), and
    the display must not follow it there.
    """
    if not stream.isatty():
        yield PlainProgress(stream)
        return
    with os.fdopen(os.dup(stream.fileno()), "w", encoding="utf-8") as terminal:
        display = _live_display(terminal)
        if display is None:
            yield PlainProgress(stream)
            return
        with display:
            yield LiveProgress(display)


def _live_display(terminal: TextIO) -> RichDisplay | None:
    try:
        from rich.console import Console
        from rich.progress import Progress as RichDisplay
        from rich.progress import SpinnerColumn, TextColumn
    except ImportError:  # rich is optional: plain lines then
        return None
    return RichDisplay(
        SpinnerColumn(finished_text="[green]✓[/green]"),
        TextColumn(f"{PREFIX}: {{task.description}}"),
        TextColumn("{task.elapsed:.1f} s", style="progress.elapsed"),
        console=Console(file=terminal, force_terminal=True),
    )


@contextlib.contextmanager
def stage(
    progress: Progress | None, timings: dict[str, float], name: str, label: str
) -> Iterator[None]:
    """Time a stage into ``timings[name]`` and tell ``progress`` about it."""
    if progress is not None:
        progress.started(name, label)
    began = time.perf_counter()
    ok = False
    try:
        yield
        ok = True
    finally:
        timings[name] = round(time.perf_counter() - began, 3)
        if progress is not None:
            progress.finished(name, timings[name], ok=ok)
