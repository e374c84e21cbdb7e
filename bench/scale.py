"""Broker RSS and recovery time as its log grows (20,000,000 messages by default).

    .venv/bin/python bench/scale.py [--total 20000000] [--checkpoints 5000000,10000000,20000000]

Fills one broker subprocess (`--fsync never` by default) with `--total` messages of
`--body-bytes` bodies over `--subjects` subjects, through the project's `AsyncBrokerClient`
on `--connections` connections, as fast as it takes them. At each checkpoint count it reads
the broker's memory (RSS, USS, RssAnon / RssFile), kills it with SIGKILL, starts it again on
the same data directory and times the recovery (exec to /healthz 200, and the seconds the
broker logs with its `broker.recovered` event), reads its memory after recovery and after
one produce round, and produces again a sample of ids stored early on: every one must be
answered `duplicate` with the seq it got first. The key figure is the RSS slope in bytes per
retained message between checkpoints (target <= 8 B/msg). A wrong duplicate answer, or a
recovery that counts another number of messages than were stored, makes the exit status 1.

Smoke run (seconds): --total 20000 --checkpoints 10000,20000 --settle 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._broker import BenchBroker
from qmq_outbox.client import AsyncBrokerClient
from qmq_outbox.envelope import ProduceResult
from qmq_outbox.errors import BrokerUnavailable

SAMPLE_SIZE = 1000
SAMPLE_SPAN = 1_000_000  # the sample comes from the first million messages ...
SAMPLE_SHARE = 20  # ... or from the first 1/20 (5 %) when the run is smaller
DISK_PER_MESSAGE_OVERHEAD = 110  # bytes beside the body: record frame, id, subject, index entry
DISK_MARGIN = 3  # refuse to start with less free space than this many times the estimate
SLOPE_TARGET = 8.0  # bytes of RSS per retained message
GAUGE_WORDS = ("index", "dedup", "rss")
SEND_ATTEMPTS = 5
LOG_TAIL = 20  # lines of the broker's log quoted when it fails to start
LOG_WAIT_S = 5.0  # how long a restarted broker's recovery event is waited for
MB = 1024 * 1024


class BenchFailure(Exception):
    """The benchmark cannot run or cannot go on (not a broker answer found wrong)."""


# --- settings ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    total: int
    checkpoints: tuple[int, ...]
    subjects: int
    body_bytes: int
    batch: int
    connections: int
    fsync: str
    data_dir: Path | None
    keep: bool
    json_path: Path | None
    settle_s: float
    progress_every: int
    start_timeout_s: float
    broker_args: tuple[str, ...]


def _positive(text: str) -> int:
    value = int(text.replace("_", ""))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 or more")
    return value


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(_positive(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text}: not a list of counts") from exc
    if not counts or list(counts) != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"{text}: give distinct counts in increasing order")
    return counts


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--total", type=_positive, default=20_000_000, help="messages stored in all")
    add(
        "--checkpoints",
        type=_counts,
        help="stored counts at which memory is read and the broker killed and restarted"
        " (--total is added when missing); default: a quarter, a half and all of --total"
        " (5000000,10000000,20000000 for the default --total)",
    )
    add("--subjects", type=_positive, default=4, help="subjects the messages are spread over")
    add("--body-bytes", type=_positive, default=100, help="body size of every message")
    add("--batch", type=_positive, default=1000, help="messages per produce request (max 1000)")
    add("--connections", type=_positive, default=4, help="concurrent produce requests")
    add("--fsync", default="never", help="the broker's --fsync during the whole run")
    add(
        "--data-dir",
        type=Path,
        help="run directory (must be absent or empty; holds the broker's data and log);"
        " default: a new temporary directory",
    )
    add("--keep", action="store_true", help="keep the run directory at the end")
    add("--json", dest="json_path", type=Path, help="write the report as JSON here too")
    add(
        "--settle",
        dest="settle_s",
        type=float,
        default=2.0,
        help="seconds to wait before each memory reading",
    )
    add("--progress-every", type=_positive, default=1_000_000, help="messages between progress")
    add(
        "--start-timeout",
        dest="start_timeout_s",
        type=float,
        default=1800.0,
        help="seconds a restart may take to answer /healthz 200",
    )
    add(
        "--broker-args",
        default="",
        help="more broker flags, one shell-quoted string, e.g. '--segment-size 268435456'",
    )
    args = parser.parse_args(argv)
    if args.batch > 1000:
        parser.error("--batch: the broker takes at most 1000 messages per request")
    checkpoints = args.checkpoints or tuple(
        sorted({max(1, args.total // 4), max(1, args.total // 2), args.total})
    )
    if checkpoints[-1] > args.total:
        parser.error("--checkpoints: every checkpoint must be at most --total")
    if checkpoints[-1] != args.total:
        checkpoints = (*checkpoints, args.total)
    return Settings(
        total=args.total,
        checkpoints=checkpoints,
        subjects=args.subjects,
        body_bytes=args.body_bytes,
        batch=args.batch,
        connections=args.connections,
        fsync=args.fsync,
        data_dir=args.data_dir,
        keep=args.keep,
        json_path=args.json_path,
        settle_s=args.settle_s,
        progress_every=args.progress_every,
        start_timeout_s=args.start_timeout_s,
        broker_args=tuple(shlex.split(args.broker_args)),
    )


# --- the messages --------------------------------------------------------------------------------
# Message n has id "scale-{n}" and goes to subject n % subjects. A request carries one
# subject's messages of a stretch of subjects x batch numbers, so every request names one
# subject (the broker's fast path) while any stretch of numbers covers all subjects.


def message_id(n: int) -> str:
    return f"scale-{n}"


def subject_name(n: int, subjects: int) -> str:
    return f"scale.s{n % subjects}"


def sample_numbers(*, total: int, first_checkpoint: int, subjects: int) -> list[int]:
    """Up to 1,000 distinct message numbers spread evenly over the first million (or 5 %)
    and round-robin over the subjects; all stored before the first checkpoint."""
    span = sample_span(total=total, first_checkpoint=first_checkpoint, subjects=subjects)
    size = min(SAMPLE_SIZE, span)
    step = span // size
    # i * step moved to the place of subject i % subjects in its block of `subjects` numbers:
    # blocks of two i of one subject are `subjects` numbers apart or more, so all differ
    return [i * step - i * step % subjects + i % subjects for i in range(size)]


def sample_span(*, total: int, first_checkpoint: int, subjects: int) -> int:
    """How many of the first messages the sample is taken from: whole blocks of one number
    per subject (unless fewer), within the first checkpoint."""
    span = min(SAMPLE_SPAN, max(1, total // SAMPLE_SHARE), first_checkpoint)
    return span - span % subjects if span >= subjects else span


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    subject: int
    numbers: Sequence[int]  # each n with n % subjects == subject


def requests(start: int, end: int, *, subjects: int, batch: int) -> Iterator[Request]:
    """The produce requests that store messages start..end-1, each of one subject."""
    stretch = subjects * batch
    for low in range(start, end, stretch):
        high = min(low + stretch, end)
        for subject in range(subjects):
            first = low + (subject - low) % subjects
            if first < high:
                yield Request(subject=subject, numbers=range(first, high, subjects))


def request_body(request: Request, *, subjects: int, body: str) -> bytes:
    name = subject_name(request.subject, subjects)
    return orjson.dumps(
        {
            "messages": [
                {"id": message_id(n), "subject": name, "body": body, "body_encoding": "utf-8"}
                for n in request.numbers
            ]
        }
    )


async def send(client: AsyncBrokerClient, body: bytes) -> tuple[list[ProduceResult], bool]:
    """Produce, retrying while the broker is unavailable (a retry is safe: ids dedup).
    Returns the results and whether the request was sent more than once."""
    for attempt in range(SEND_ATTEMPTS):
        try:
            return await client.produce_raw(body), attempt > 0
        except BrokerUnavailable:
            if attempt == SEND_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


# --- fill ----------------------------------------------------------------------------------------


class Progress:
    """A timestamped line every ``every`` messages stored."""

    def __init__(self, *, every: int, done: int) -> None:
        self._every = every
        self._done = done
        self._next = (done // every + 1) * every
        self._began = time.monotonic()
        self._began_at = done

    def add(self, stored: int) -> None:
        self._done += stored
        if self._done < self._next:
            return
        while self._next <= self._done:
            self._next += self._every
        rate = (self._done - self._began_at) / max(time.monotonic() - self._began, 1e-9)
        print(f"{stamp()} {self._done:>12,} stored ({rate:,.0f} msgs/s this stage)", flush=True)


async def fill(
    url: str, settings: Settings, *, start: int, end: int, sample_seqs: dict[str, int | None]
) -> float:
    """Store messages start..end-1; returns the seconds it took. Records the seq of every
    sample id it stores in ``sample_seqs``."""
    body = "x" * settings.body_bytes
    pending = requests(start, end, subjects=settings.subjects, batch=settings.batch)
    progress = Progress(every=settings.progress_every, done=start)

    async def worker(client: AsyncBrokerClient) -> None:
        for request in pending:  # one iterator shared by the workers: each takes the next
            results, retried = await send(
                client, request_body(request, subjects=settings.subjects, body=body)
            )
            if len(results) != len(request.numbers):
                raise BenchFailure(f"fill: {len(results)} results for {len(request.numbers)}")
            for result in results:
                if result.status != "stored" and not (retried and result.status == "duplicate"):
                    raise BenchFailure(f"fill: {result.id} answered {result.status}")
                if result.id in sample_seqs:
                    sample_seqs[result.id] = result.seq
            progress.add(len(results))

    async with AsyncBrokerClient(url, max_connections=settings.connections, timeout=120) as client:
        began = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(settings.connections)))
        return time.monotonic() - began


# --- the duplicate check -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DuplicateCheck:
    asked: int
    right: int
    wrong: tuple[str, ...]  # the first few wrong answers, for the failure message

    @property
    def passed(self) -> bool:
        return self.asked > 0 and self.right == self.asked


async def check_duplicates(
    url: str, settings: Settings, sample_seqs: dict[str, int | None]
) -> DuplicateCheck:
    """Produce every sample id again: each must be a duplicate carrying its first seq."""
    text = "x" * settings.body_bytes
    numbers = sorted(int(i.removeprefix("scale-")) for i in sample_seqs)
    right = 0
    wrong: list[str] = []
    async with AsyncBrokerClient(url, max_connections=1, timeout=120) as client:
        for subject in range(settings.subjects):
            mine = [n for n in numbers if n % settings.subjects == subject]
            for at in range(0, len(mine), settings.batch):
                chunk = Request(subject=subject, numbers=mine[at : at + settings.batch])
                body = request_body(chunk, subjects=settings.subjects, body=text)
                results, _ = await send(client, body)
                for result in results:
                    expected = sample_seqs.get(result.id)
                    if result.status == "duplicate" and result.seq == expected:
                        right += 1
                    elif len(wrong) < 5:
                        wrong.append(
                            f"{result.id}: {result.status} seq {result.seq} (first seq {expected})"
                        )
    return DuplicateCheck(asked=len(numbers), right=right, wrong=tuple(wrong))


# --- readings of the broker ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Memory:
    """One reading of the broker process, in bytes (None where the system does not say)."""

    rss: int
    uss: int | None
    anon: int | None  # RssAnon: the heap, what an in-memory index or dedup table costs
    file: int | None  # RssFile: mapped files (an mmapped index shows here)
    peak: int | None  # VmHWM: the most RSS the process has had


def read_memory(pid: int) -> Memory:
    process = psutil.Process(pid)
    rss = process.memory_info().rss
    uss: int | None
    try:
        uss = process.memory_full_info().uss
    except (psutil.AccessDenied, AttributeError):
        uss = None
    status: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return Memory(
        rss=rss,
        uss=uss,
        anon=status.get("RssAnon"),
        file=status.get("RssFile"),
        peak=status.get("VmHWM"),
    )


def broker_memory(broker: BenchBroker) -> Memory:
    if broker.proc is None:
        raise BenchFailure("the broker is not running")
    return read_memory(broker.proc.pid)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Recovered:
    """What the broker logged about its last recovery (None: it did not log the field)."""

    seconds: float | None
    messages: int | None


def recovered_events(log: Path) -> list[Recovered]:
    """Every ``broker.recovered`` event of the broker's JSON log lines, oldest first."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        if "broker.recovered" not in line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(event, dict) or event.get("action") != "broker.recovered":
            continue
        seconds, messages = event.get("seconds"), event.get("messages")
        events.append(
            Recovered(
                seconds=float(seconds) if isinstance(seconds, int | float) else None,
                messages=messages if isinstance(messages, int) else None,
            )
        )
    return events


def logged_recovery(log: Path, *, known: int) -> Recovered:
    """The recovery event after the ``known`` first ones; the line may land just after
    /healthz said 200, so it is waited for a little (fields None if it never comes)."""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        events = recovered_events(log)
        if len(events) > known:
            return events[-1]
        if time.monotonic() > deadline:
            return Recovered(seconds=None, messages=None)
        time.sleep(0.05)


def wanted_gauges(text: str) -> dict[str, float]:
    """The gauges (and untyped samples) of a Prometheus text page whose names hold one of
    GAUGE_WORDS, by sample (name and labels)."""
    kinds: dict[str, str] = {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) == 4:
                kinds[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        if kinds.get(name, "untyped") not in ("gauge", "untyped"):
            continue
        if any(word in name for word in GAUGE_WORDS):
            try:
                found[sample] = float(value)
            except ValueError:
                continue
    return found


def broker_gauges(url: str) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    return wanted_gauges(response.text)


def disk_bytes(path: Path) -> int:
    """Blocks the files under ``path`` take on disk."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:  # a file the broker removed meanwhile
                continue
    return total


def stamp() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


# --- the run -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    messages: int
    fill_rate: float  # msgs/s of the stage that ended here
    load_average: tuple[float, float, float]  # at the end of that stage
    before_kill: Memory
    disk: int  # bytes of the data directory
    until_healthy_s: float  # exec to /healthz 200
    recovered: Recovered
    after_recovery: Memory
    after_round: Memory  # after one produce round (the duplicate check)
    duplicates: DuplicateCheck
    gauges: dict[str, float]

    @property
    def count_differs(self) -> bool:
        """The broker recovered another number of messages than were stored."""
        counted = self.recovered.messages
        return counted is not None and counted != self.messages

    @property
    def readings(self) -> tuple[Memory, Memory, Memory]:
        """The three readings the slopes compare, in the report's column order."""
        return (self.before_kill, self.after_recovery, self.after_round)

    @staticmethod
    def readings_of_empty(empty: Memory) -> tuple[Memory, Memory, Memory]:
        return (empty, empty, empty)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    command: str
    started: str
    machine: str
    settings: Settings
    sample_size: int
    sample_span: int
    sample_subjects: int
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    empty: Memory
    checkpoints: tuple[Checkpoint, ...]

    @property
    def failed(self) -> bool:
        return any(not c.duplicates.passed or c.count_differs for c in self.checkpoints)


def estimated_disk(settings: Settings) -> int:
    return settings.total * (settings.body_bytes + DISK_PER_MESSAGE_OVERHEAD)


def prepare_run_dir(settings: Settings) -> Path:
    """The run directory, checked empty and with room for the whole fill, then made."""
    if settings.data_dir is not None:
        root = settings.data_dir
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise BenchFailure(f"--data-dir {root}: must be absent or an empty directory")
        where = next(path for path in (root, *root.parents) if path.exists())
    else:
        where = Path(os.environ.get("QMQ_BENCH_DIR") or tempfile.gettempdir())
    need = DISK_MARGIN * estimated_disk(settings)
    free = shutil.disk_usage(where).free
    if free < need:
        raise BenchFailure(
            f"not enough free space at {where}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB"
            f" needed ({DISK_MARGIN} x the {estimated_disk(settings) / 1e9:.1f} GB that"
            f" {settings.total:,} messages of {settings.body_bytes} B take); use --data-dir"
            " elsewhere or a smaller --total"
        )
    if settings.data_dir is None:
        return Path(tempfile.mkdtemp(prefix="qmq-scale-", dir=where))
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings.data_dir


def settle(settings: Settings) -> None:
    time.sleep(settings.settle_s)


def start(broker: BenchBroker, settings: Settings) -> float:
    """Start the broker and wait for /healthz 200; a failure quotes the end of its log
    (the run directory, log included, is deleted at the end without --keep)."""
    try:
        return broker.start(timeout=settings.start_timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        raise BenchFailure("\n".join([f"{exc}; the log ends:", *log_tail(broker.log)])) from exc


def log_tail(log: Path) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
    except OSError:
        return []


def run(settings: Settings, root: Path) -> tuple[Memory, tuple[Checkpoint, ...], list[int]]:
    """Fill, kill and restart at each checkpoint. Returns the empty broker's memory, the
    checkpoints and the sample's message numbers."""
    data = root / "data"
    broker = BenchBroker(data, "--fsync", settings.fsync, *settings.broker_args)
    numbers = sample_numbers(
        total=settings.total, first_checkpoint=settings.checkpoints[0], subjects=settings.subjects
    )
    sample_seqs: dict[str, int | None] = {message_id(n): None for n in numbers}
    checkpoints: list[Checkpoint] = []
    start(broker, settings)
    try:
        settle(settings)
        empty = broker_memory(broker)
        print(f"{stamp()} empty broker: RSS {empty.rss / MB:.1f} MB", flush=True)
        stored = 0
        for target in settings.checkpoints:
            seconds = asyncio.run(
                fill(broker.url, settings, start=stored, end=target, sample_seqs=sample_seqs)
            )
            rate = (target - stored) / max(seconds, 1e-9)
            stored = target
            load = os.getloadavg()
            missing = [i for i, seq in sample_seqs.items() if seq is None]
            if missing:
                raise BenchFailure(f"no seq recorded for sample ids {missing[:3]}")
            settle(settings)
            before_kill = broker_memory(broker)
            disk = disk_bytes(data)
            print(
                f"{stamp()} checkpoint {target:,}: filled at {rate:,.0f} msgs/s, RSS"
                f" {before_kill.rss / MB:.1f} MB; kill -9 and restart",
                flush=True,
            )
            known = len(recovered_events(broker.log))
            broker.kill9()
            until_healthy = start(broker, settings)
            recovered = logged_recovery(broker.log, known=known)
            settle(settings)
            after_recovery = broker_memory(broker)
            duplicates = asyncio.run(check_duplicates(broker.url, settings, sample_seqs))
            settle(settings)
            after_round = broker_memory(broker)
            checkpoint = Checkpoint(
                messages=target,
                fill_rate=rate,
                load_average=load,
                before_kill=before_kill,
                disk=disk,
                until_healthy_s=until_healthy,
                recovered=recovered,
                after_recovery=after_recovery,
                after_round=after_round,
                duplicates=duplicates,
                gauges=broker_gauges(broker.url),
            )
            checkpoints.append(checkpoint)
            print(f"{stamp()} checkpoint {target:,}: {recovery_line(checkpoint)}", flush=True)
            for line in failure_lines(checkpoint):
                print(line, file=sys.stderr, flush=True)
    except Exception as exc:
        if not isinstance(exc, BenchFailure):  # its message already quotes what it needs
            print("the broker's log ends:", *log_tail(broker.log), sep="\n", file=sys.stderr)
        raise
    finally:
        broker.stop()
    return empty, tuple(checkpoints), numbers


# --- the report ----------------------------------------------------------------------------------


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:,.1f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def slope(before: int, after: int, messages: int) -> float:
    """Bytes of memory per message retained between two readings."""
    return (after - before) / messages if messages else math.nan


def recovery_line(c: Checkpoint) -> str:
    return (
        f"healthy after {c.until_healthy_s:.2f} s (broker's own {_seconds(c.recovered.seconds)}"
        f" s), RSS {_mb(c.after_recovery.rss)} MB, duplicates {c.duplicates.right}"
        f"/{c.duplicates.asked} right"
    )


def failure_lines(c: Checkpoint) -> list[str]:
    lines = []
    if not c.duplicates.passed:
        lines += [
            "!" * 78,
            f"!!! FAILED at {c.messages:,}: {c.duplicates.asked - c.duplicates.right} of"
            f" {c.duplicates.asked} sample ids were not answered duplicate with their first seq",
            *(f"!!!   {wrong}" for wrong in c.duplicates.wrong),
            "!" * 78,
        ]
    if c.count_differs:
        lines += [
            "!" * 78,
            f"!!! FAILED at {c.messages:,}: the broker recovered {c.recovered.messages:,}"
            f" messages, {c.messages:,} were stored",
            "!" * 78,
        ]
    return lines


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _load(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def render(report: Report) -> str:
    s, cps = report.settings, report.checkpoints
    lines = [
        f"`{report.command}` on {report.started}, {report.machine}",
        "",
        f"{s.total:,} messages of {s.body_bytes} B over {s.subjects} subjects, batches of"
        f" {s.batch}, {s.connections} connections, broker `--fsync {s.fsync}`"
        + (f" {shlex.join(s.broker_args)}" if s.broker_args else "")
        + f"; memory read {s.settle_s:g} s after each step."
        f" Load average (1 / 5 / 15 min) at start {_load(report.load_start)},"
        f" at end {_load(report.load_end)}.",
        "",
        f"Empty broker: RSS {_mb(report.empty.rss)} MB, USS {_mb(report.empty.uss)} MB.",
        "",
        "Fill and recovery after kill -9:",
        "",
        *_table(
            (
                "messages",
                "fill msgs/s",
                "load 1 / 5 / 15 at end of fill",
                "exec to /healthz 200, s",
                "broker's recovery, s",
                "messages recovered",
                "duplicates right",
                "data dir MB",
            ),
            [
                (
                    f"{c.messages:,}",
                    f"{c.fill_rate:,.0f}",
                    _load(c.load_average),
                    f"{c.until_healthy_s:.2f}",
                    _seconds(c.recovered.seconds),
                    "-" if c.recovered.messages is None else f"{c.recovered.messages:,}",
                    f"{c.duplicates.right:,} / {c.duplicates.asked:,}"
                    + ("" if c.duplicates.passed else " **FAILED**"),
                    _mb(c.disk),
                )
                for c in cps
            ],
        ),
        "",
        "Broker memory, MB (RSS = RssAnon + RssFile + shared memory; peak = VmHWM of the"
        " restarted process, i.e. the most it held while recovering):",
        "",
        *_table(
            (
                "messages",
                "RSS before kill",
                "USS before kill",
                "RSS after recovery",
                "peak during recovery",
                "RSS after produce round",
                "USS after produce round",
                "anon / file after round",
            ),
            [
                (
                    f"{c.messages:,}",
                    _mb(c.before_kill.rss),
                    _mb(c.before_kill.uss),
                    _mb(c.after_recovery.rss),
                    _mb(c.after_recovery.peak),
                    _mb(c.after_round.rss),
                    _mb(c.after_round.uss),
                    f"{_mb(c.after_round.anon)} / {_mb(c.after_round.file)}",
                )
                for c in cps
            ],
        ),
        "",
        f"RSS slope, bytes per retained message (target <= {SLOPE_TARGET:g} B/msg):",
        "",
        *_table(
            ("span", "before kill", "after recovery", "after produce round"), slope_rows(report)
        ),
        "",
        target_line(report),
        "",
        f"Duplicate check: {report.sample_size:,} ids from the first"
        f" {report.sample_span:,} messages over {report.sample_subjects} subjects, produced"
        " again after every restart; each must answer `duplicate` with its first seq.",
        "",
        "Broker gauges (/metrics names holding " + ", ".join(GAUGE_WORDS) + "):",
    ]
    gauges = [(c.messages, name, value) for c in cps for name, value in sorted(c.gauges.items())]
    if gauges:
        lines += [f"- at {m:,}: {name} = {value:,.0f}" for m, name, value in gauges]
    else:
        lines.append("- none exported")
    if report.failed:
        lines += ["", "**FAILED**: see the duplicates and recovered counts above."]
    return "\n".join(lines)


def slope_rows(report: Report) -> list[tuple[str, ...]]:
    """Slopes from the empty broker to the first checkpoint, between consecutive ones and
    from the first to the last (when there are more than two)."""
    cps = report.checkpoints
    empty = Checkpoint.readings_of_empty(report.empty)

    def row(label: str, start: int, a: tuple[Memory, ...], b: Checkpoint) -> tuple[str, ...]:
        ends = b.readings
        figures = (slope(x.rss, y.rss, b.messages - start) for x, y in zip(a, ends, strict=True))
        return (label, *(f"{figure:.1f}" for figure in figures))

    rows = [row(f"empty -> {cps[0].messages:,}", 0, empty, cps[0])]
    rows += [
        row(f"{a.messages:,} -> {b.messages:,}", a.messages, a.readings, b)
        for a, b in itertools.pairwise(cps)
    ]
    if len(cps) > 2:
        first, last = cps[0], cps[-1]
        label = f"first -> last ({first.messages:,} -> {last.messages:,})"
        rows.append(row(label, first.messages, first.readings, last))
    return rows


def key_slopes(report: Report) -> tuple[float, float] | None:
    """First -> last checkpoint slope of RSS before kill and after the produce round."""
    cps = report.checkpoints
    if len(cps) < 2:
        return None
    first, last = cps[0], cps[-1]
    span = last.messages - first.messages
    return (
        slope(first.before_kill.rss, last.before_kill.rss, span),
        slope(first.after_round.rss, last.after_round.rss, span),
    )


def target_line(report: Report) -> str:
    slopes = key_slopes(report)
    if slopes is None:
        return "Target: needs two checkpoints or more (the slope from the first to the last)."
    met = all(value <= SLOPE_TARGET for value in slopes)
    return (
        f"Target (first -> last, running and restarted broker alike): {slopes[0]:.1f} and"
        f" {slopes[1]:.1f} B/msg against <= {SLOPE_TARGET:g}: {'met' if met else 'MISSED'}"
    )


def as_json(report: Report) -> str:
    doc = dataclasses.asdict(report)
    doc["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in doc["settings"].items()}
    doc["failed"] = report.failed
    doc["slopes_first_to_last"] = key_slopes(report)
    return json.dumps(doc, indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    command = "python bench/scale.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        root = prepare_run_dir(settings)
    except BenchFailure as exc:
        print(f"bench/scale.py: {exc}", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{stamp()} run directory {root}; load average {_load(load_start)}", flush=True)
    try:
        empty, checkpoints, numbers = run(settings, root)
    except BenchFailure as exc:
        print(f"bench/scale.py: {exc}", file=sys.stderr)
        return 2
    finally:
        if not settings.keep:
            shutil.rmtree(root, ignore_errors=True)
    report = Report(
        command=command,
        started=started,
        machine=f"{platform.node()}: {os.cpu_count()} vCPU, Python {platform.python_version()}",
        settings=settings,
        sample_size=len(numbers),
        sample_span=sample_span(
            total=settings.total,
            first_checkpoint=settings.checkpoints[0],
            subjects=settings.subjects,
        ),
        sample_subjects=len({n % settings.subjects for n in numbers}),
        load_start=load_start,
        load_end=os.getloadavg(),
        empty=empty,
        checkpoints=checkpoints,
    )
    print("\n" + render(report), flush=True)
    if settings.json_path is not None:
        settings.json_path.write_text(as_json(report))
    if report.failed:
        for checkpoint in checkpoints:
            for line in failure_lines(checkpoint):
                print(line, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
