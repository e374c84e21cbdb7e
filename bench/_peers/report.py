"""The tables (Markdown, for docs/benchmarks.md) and the JSON of a run."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from bench._peers.workloads import Result, Settings

THROUGHPUT = ("produce", "consume")
BASELINE = "qmq"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    round: int
    workload: str
    system: str
    result: Result

    def as_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "round": self.round,
            "workload": self.workload,
            "system": self.system,
            "messages": r.messages,
            "seconds": r.cost.seconds,
            "rate": r.rate,
            "p50_ms": r.p50_ms,
            "p99_ms": r.p99_ms,
            "lost": r.lost,
            "client_cpu_s": r.cost.client_cpu,
            "server_cpu_s": r.cost.server_cpu,
            "client_us_per_msg": r.client_us,
            "server_us_per_msg": r.server_us,
        }


def workload_title(workload: str, settings: Settings) -> str:
    return {
        "produce": f"durable produce, {settings.connections} connections x batches of"
        f" {settings.batch} (msgs/s)",
        "consume": f"pull + ack, batches of {settings.batch}, {settings.consumers} consumers"
        " (msgs/s)",
        "single": "single-message produce p50 / p99 (ms)",
        "e2e": f"end to end at {settings.rate:,.0f} msg/s offered, p50 / p99 (ms); server CPU"
        " per message (µs)",
    }[workload]


def _median(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else math.nan


def _rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


class Report:
    """Medians per system, qmq / peer ratios per round, CPU per message."""

    def __init__(
        self, *, samples: list[Sample], systems: list[tuple[str, str]], settings: Settings
    ) -> None:
        self.samples = samples
        self.systems = systems  # (name, title) in column order
        self.settings = settings
        self.workloads = list(dict.fromkeys(s.workload for s in samples))
        self.rounds = sorted({s.round for s in samples})

    def _of(self, workload: str, system: str) -> list[Result]:
        return [s.result for s in self.samples if s.workload == workload and s.system == system]

    def _one(self, workload: str, system: str, round_: int) -> Result | None:
        for s in self.samples:
            if (s.workload, s.system, s.round) == (workload, system, round_):
                return s.result
        return None

    def median(self, workload: str, system: str, field: Callable[[Result], float | None]) -> float:
        return _median([field(r) for r in self._of(workload, system)])

    def cell(self, workload: str, system: str) -> str:
        results = self._of(workload, system)
        if not results:
            return "-"
        if workload in THROUGHPUT:
            return _rate(self.median(workload, system, lambda r: r.rate))
        p50 = self.median(workload, system, lambda r: r.p50_ms)
        p99 = self.median(workload, system, lambda r: r.p99_ms)
        lost = sum(r.lost for r in results)
        cell = f"{_ms(p50)} / {_ms(p99)}"
        if workload == "e2e":  # what a message costs the server at this rate, beside it
            cell += f"; {self.median(workload, system, lambda r: r.server_us):,.0f} µs"
        return cell + (f" ({lost:,} lost)" if lost else "")

    def medians_table(self) -> list[str]:
        rounds = len(self.rounds)
        head = f"| workload (1 KiB bodies), median of {rounds} round{'s' * (rounds != 1)} |"
        lines = [head + "".join(f" {title} |" for _, title in self.systems)]
        lines.append("|---|" + "---|" * len(self.systems))
        for workload in self.workloads:
            cells = "".join(f" {self.cell(workload, name)} |" for name, _ in self.systems)
            lines.append(f"| {workload_title(workload, self.settings)} |{cells}")
        return lines

    def ratio(self, workload: str, peer: str, round_: int) -> tuple[float, ...] | None:
        ours, theirs = self._one(workload, BASELINE, round_), self._one(workload, peer, round_)
        if ours is None or theirs is None:
            return None
        if workload in THROUGHPUT:
            return (ours.rate / theirs.rate,)
        return (
            (ours.p50_ms or math.nan) / (theirs.p50_ms or math.nan),
            (ours.p99_ms or math.nan) / (theirs.p99_ms or math.nan),
        )

    def ratios_table(self) -> list[str]:
        peers = [(name, title) for name, title in self.systems if name != BASELINE]
        if not peers or BASELINE not in dict(self.systems):
            return []
        lines = [
            "| workload | qmq / |" + "".join(f" round {r} |" for r in self.rounds) + " median |",
            "|---|---|" + "---|" * (len(self.rounds) + 1),
        ]
        for workload in self.workloads:
            for name, title in peers:
                per_round = [self.ratio(workload, name, r) for r in self.rounds]
                present = [p for p in per_round if p is not None]
                if not present:
                    continue
                medians = tuple(_median([p[i] for p in present]) for i in range(len(present[0])))
                cells = "".join(f" {_ratio(p)} |" for p in per_round)
                lines.append(f"| {workload} | {title} |{cells} {_ratio(medians)} |")
        return lines

    def cpu_table(self) -> list[str]:
        lines = ["| workload |" + "".join(f" {title} |" for _, title in self.systems)]
        lines.append("|---|" + "---|" * len(self.systems))
        for workload in self.workloads:
            cells = ""
            for name, _ in self.systems:
                if not self._of(workload, name):
                    cells += " - |"
                    continue
                client = self.median(workload, name, lambda r: r.client_us)
                server = self.median(workload, name, lambda r: r.server_us)
                cells += f" {client:.0f} / {server:.0f} |"
            lines.append(f"| {workload} |{cells}")
        return lines

    def as_json(self) -> dict[str, Any]:
        medians = {
            workload: {
                name: {
                    "rate": self.median(workload, name, lambda r: r.rate),
                    "p50_ms": self.median(workload, name, lambda r: r.p50_ms),
                    "p99_ms": self.median(workload, name, lambda r: r.p99_ms),
                    "client_us_per_msg": self.median(workload, name, lambda r: r.client_us),
                    "server_us_per_msg": self.median(workload, name, lambda r: r.server_us),
                }
                for name, _ in self.systems
                if self._of(workload, name)
            }
            for workload in self.workloads
        }
        ratios = {
            workload: {
                name: [self.ratio(workload, name, r) for r in self.rounds]
                for name, _ in self.systems
                if name != BASELINE
            }
            for workload in self.workloads
        }
        return {
            "settings": dataclasses.asdict(self.settings),
            "systems": [name for name, _ in self.systems],
            "samples": [s.as_json() for s in self.samples],
            "medians": medians,
            "qmq_over_peer_per_round": ratios,
        }


def _ratio(values: tuple[float, ...] | None) -> str:
    if values is None:
        return "-"
    return " / ".join(f"{v:.2f}" for v in values)
