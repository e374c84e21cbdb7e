"""The tables of a flow run: medians per system, per-round ratios against pgqueuer, CPU per
message of every process, the load average at each run's start."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from bench._flow.run import WARMUP, Outcome, Settings

BASELINE = "pgqueuer"
ROLES = ("producer", "worker", "broker", "compensator", "postgres", "pg shared")


def _median(values: Sequence[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else math.nan


def _ms(outcome: Outcome, key: str) -> float:
    return outcome.latency_ms.get(key, math.nan)


def _fmt(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


class Report:
    def __init__(self, outcomes: list[Outcome], systems: list[str], settings: Settings) -> None:
        self.outcomes = outcomes
        self.systems = systems
        self.settings = settings
        self.rounds = sorted({o.round for o in outcomes})

    def _of(self, measure: str, name: str) -> list[Outcome]:
        return [o for o in self.outcomes if (o.measure, o.system) == (measure, name)]

    def _one(self, measure: str, name: str, round_: int) -> Outcome | None:
        found = [o for o in self._of(measure, name) if o.round == round_]
        return found[0] if found else None

    def _med(self, measure: str, name: str, field: Callable[[Outcome], float]) -> float:
        return _median([field(o) for o in self._of(measure, name)])

    def _present(self, measure: str) -> list[str]:
        return [name for name in self.systems if self._of(measure, name)]

    def _ratios(self, measure: str, figures: dict[str, Callable[[Outcome], float]]) -> list[str]:
        names = [n for n in self._present(measure) if n != BASELINE]
        if BASELINE not in self._present(measure) or not names:
            return []
        head = "| figure | system / pgqueuer |" + "".join(f" round {r} |" for r in self.rounds)
        lines = [head + " median |", "|---|---|" + "---|" * (len(self.rounds) + 1)]
        for label, field in figures.items():
            for name in names:
                per_round = []
                for r in self.rounds:
                    ours, theirs = self._one(measure, name, r), self._one(measure, BASELINE, r)
                    per_round.append(field(ours) / field(theirs) if ours and theirs else math.nan)
                cells = "".join(f" {_fmt(v, 2)} |" for v in per_round)
                lines.append(f"| {label} | {name} |{cells} {_fmt(_median(per_round), 2)} |")
        return ["", "Per-round ratios against pgqueuer:", "", *lines]

    def _cpu(self, measure: str) -> list[str]:
        names = self._present(measure)
        lines = [
            "| CPU µs per committed message |" + "".join(f" {n} |" for n in names),
            "|---|" + "---|" * len(names),
        ]
        for role in (*ROLES, "total"):
            per_message = functools.partial(Outcome.us_per_message, role=role)
            cells = "".join(f" {_fmt(self._med(measure, n, per_message))} |" for n in names)
            lines.append(f"| {role} |{cells}")
        return ["", *lines]

    def throughput(self) -> list[str]:
        names = self._present("throughput")
        if not names:
            return []
        s = self.settings
        lines = [
            f"### Whole flow, {s.producers} producers flat out ({s.producer_processes} processes),"
            f" one message per transaction, {s.seconds:g} s; median of {len(self.rounds)}",
            "",
            "| system | committed msg/s | drained msg/s | rolled back |",
            "|---|---|---|---|",
        ]
        for n in names:
            committed = self._med("throughput", n, lambda o: o.committed_rate)
            drained = self._med("throughput", n, lambda o: o.drained_rate)
            rolled = self._med("throughput", n, lambda o: float(o.rolled_back))
            lines.append(f"| {n} | {_fmt(committed)} | {_fmt(drained)} | {_fmt(rolled)} |")
        lines += self._cpu("throughput")
        lines += self._ratios(
            "throughput",
            {
                "committed msg/s": lambda o: o.committed_rate,
                "drained msg/s": lambda o: o.drained_rate,
                "CPU per message, total": lambda o: o.us_per_message("total"),
            },
        )
        return lines

    def latency(self) -> list[str]:
        names = self._present("latency")
        if not names:
            return []
        s = self.settings
        lines = [
            f"### Commit -> handler start at {s.rate:g} msg/s offered ({s.producers} producers,"
            f" {s.seconds:g} s, the first {WARMUP:g} s left out); median of {len(self.rounds)},"
            " ms. Late starts: transactions that began more than 5 ms after their slot (the"
            " producers did not keep up with the rate)",
            "",
            "| system | p50 | p90 | p99 | max | messages | late starts |",
            "|---|---|---|---|---|---|---|",
        ]
        for n in names:
            cells = "".join(
                f" {_fmt(self._med('latency', n, functools.partial(_ms, key=k)), 1)} |"
                for k in ("p50", "p90", "p99", "max")
            )
            count = self._med("latency", n, lambda o: o.latency_ms.get("count", math.nan))
            late = self._med("latency", n, lambda o: float(o.late))
            lines.append(f"| {n} |{cells} {_fmt(count)} | {_fmt(late)} |")
        lines += self._cpu("latency")
        lines += self._ratios(
            "latency",
            {
                "p50": lambda o: o.latency_ms.get("p50", math.nan),
                "p99": lambda o: o.latency_ms.get("p99", math.nan),
            },
        )
        return lines

    def tax(self) -> list[str]:
        if not (self._of("tax", "plain") and self._of("tax", "qmq")):
            return []
        s = self.settings
        variants = [n for n in ("plain", "onerow", "qmq") if self._of("tax", n)]
        lines = [
            f"### The outbox's tax on the producer: {s.producers} producers flat out,"
            f" {s.seconds:g} s, the same SQLAlchemy transaction without a message (plain),"
            " with one raw outbox-shaped INSERT (onerow: the floor) and with `Outbox.publish`",
            "",
            "| variant | committed msg/s | producer CPU µs/msg"
            " | of which the transactions' threads |",
            "|---|---|---|---|",
        ]
        for n in variants:
            rate = self._med("tax", n, lambda o: o.committed_rate)
            cpu = self._med("tax", n, lambda o: o.us_per_message("producer"))
            callers = self._med("tax", n, _caller_us)
            lines.append(f"| {n} | {_fmt(rate)} | {_fmt(cpu)} | {_fmt(callers)} |")
        lines += [
            "",
            "Over plain, µs per message of the producer process (of which the transactions'"
            " threads):",
            "",
            "| round | qmq - plain | onerow - plain | qmq / plain |",
            "|---|---|---|---|",
        ]
        for r in self.rounds:
            ours, plain = self._one("tax", "qmq", r), self._one("tax", "plain", r)
            floor = self._one("tax", "onerow", r)
            if not (ours and plain):
                continue
            base = plain.us_per_message("producer")
            cells = [
                f"{_fmt(o.us_per_message('producer') - base)}"
                f" ({_fmt(_caller_us(o) - _caller_us(plain))})"
                if o
                else "-"
                for o in (ours, floor)
            ]
            ratio = _fmt(ours.us_per_message("producer") / base, 2)
            lines.append(f"| {r} | {cells[0]} | {cells[1]} | {ratio} |")
        return lines

    def loads(self) -> list[str]:
        lines = ["", "Load average (1 / 5 / 15 min) at each run's start:", ""]
        for o in self.outcomes:
            load = " / ".join(f"{v:.2f}" for v in o.load)
            lines.append(f"- round {o.round}, {o.measure}, {o.system}: {load}")
        return lines

    def markdown(self) -> str:
        blocks = [self.throughput(), self.latency(), self.tax(), self.loads()]
        return "\n".join(line for block in blocks if block for line in [*block, ""])

    def as_json(self) -> dict[str, Any]:
        return {
            "outcomes": [
                {
                    "measure": o.measure,
                    "system": o.system,
                    "round": o.round,
                    "load": o.load,
                    "committed": o.committed,
                    "rolled_back": o.rolled_back,
                    "late": o.late,
                    "seconds": o.seconds,
                    "drained_seconds": o.drained_seconds,
                    "committed_rate": o.committed_rate,
                    "drained_rate": o.drained_rate,
                    "cpu_s": o.cpu,
                    "latency_ms": o.latency_ms,
                }
                for o in self.outcomes
            ]
        }


def _caller_us(outcome: Outcome) -> float:
    """The transaction threads' own CPU per committed message (the rest of the producer
    process's is its background work: the outbox's dispatcher)."""
    return outcome.caller_cpu / outcome.committed * 1e6
