"""The console's answers: the broker-wide overview and a subject's extra view (consumers
seen, oldest unacked message, the last hour's history, ordered partitions' owners).

Read-only and on the event loop, like ``StatsService``; what a caller may see is decided
by the ``Visibility`` it passes (the HTTP layer's token check), so nothing here knows of
HTTP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qmq_broker.clock import Clock
from qmq_broker.console.recent_consumers import RecentConsumers
from qmq_broker.console.sampler import ConsoleSampler, backlog_key, in_key, out_key
from qmq_broker.errors import NotFound
from qmq_broker.lifecycle import Lifecycle
from qmq_broker.messages import rfc3339
from qmq_broker.pulls.ordered import OrderedPulls
from qmq_broker.stats import StatsService, SubjectDetail

RECENT_CONSUMER_S = 60.0
"""A consumer heard from within this long is shown as one of its group's consumers."""

Visibility = Callable[[str, str | None], bool]
"""Whether the caller may see a subject (group ``None``) or one of its groups."""


def _everything(subject: str, group: str | None) -> bool:
    return True


def _rate(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ConsoleService:
    """The console's two views, from the stats, the sampled history and who pulled lately."""

    lifecycle: Lifecycle
    stats: StatsService
    sampler: ConsoleSampler
    recent_consumers: RecentConsumers
    ordered: OrderedPulls
    clock: Clock

    async def sample_loop(self) -> None:
        """The sampler's loop, for the broker to supervise."""
        await self.sampler.run()

    async def sample(self) -> None:
        """One sample now, besides the loop's."""
        await self.sampler.sample()

    def overview(self, *, sees: Visibility = _everything) -> dict[str, Any]:
        """Every subject the caller sees with its groups' counters summed, rates, the oldest
        unacked message's age; broker-wide health, disk use and fsync latency."""
        now_us = self.clock.wall_us()
        history = self.sampler.history
        subjects: list[dict[str, Any]] = []
        for summary in self.stats.subjects():
            name = summary.subject
            if not sees(name, None):
                continue
            try:
                detail: SubjectDetail | None = self.stats.subject(name)
            except NotFound:  # declared, nothing stored or pulled yet
                detail = None
            groups = [] if detail is None else [g for g in detail.groups if sees(name, g.group)]
            oldest = self.stats.oldest_unacked(name)
            shown = [oldest[g.group] for g in groups if g.group in oldest]
            subjects.append(
                {
                    "subject": name,
                    "ordered": self.ordered.ordered(name),
                    "messages": summary.messages,
                    "bytes": summary.bytes,
                    "groups": len(groups),
                    "backlog": sum(g.backlog for g in groups),
                    "in_flight": sum(g.in_flight for g in groups),
                    "retrying": sum(g.retrying for g in groups),
                    "dead": sum(g.dead for g in groups),
                    "in_per_s": _rate(history.latest(in_key(name))),
                    "out_per_s": _total(history.latest(out_key(name, g.group)) for g in groups),
                    "oldest_unacked_age_s": _age(now_us, min(shown) if shown else None),
                }
            )
        latest = self.sampler.latest
        ages = [age for s in subjects if (age := s["oldest_unacked_age_s"]) is not None]
        return {
            "status": self.lifecycle.status.value,
            "at": rfc3339(now_us),
            "sample_interval_s": self.sampler.interval_s,
            "sampled_at": None if latest is None else rfc3339(int(latest.at * 1_000_000)),
            "in_per_s": _total(s["in_per_s"] for s in subjects),
            "out_per_s": _total(s["out_per_s"] for s in subjects),
            "backlog": sum(s["backlog"] for s in subjects),
            "dead": sum(s["dead"] for s in subjects),
            "oldest_unacked_age_s": max(ages) if ages else None,
            "disk": None
            if latest is None or latest.disk is None
            else {
                "data_bytes": latest.disk.data_bytes,
                "free_bytes": latest.disk.free_bytes,
                "total_bytes": latest.disk.total_bytes,
            },
            "fsync": {
                "fsyncs": 0 if latest is None else latest.fsync.fsyncs,
                "mean_ms": None if latest is None else _rate(latest.fsync.mean_ms),
                "p99_ms": None if latest is None else latest.fsync.p99_ms,
            },
            "subjects": subjects,
        }

    def subject(self, name: str, *, sees: Visibility = _everything) -> dict[str, Any]:
        """A subject's groups with their consumers seen lately and oldest unacked message,
        the history of its rates and backlogs, and an ordered subject's partition owners."""
        detail = self.stats.subject(name)  # 404 for a subject the broker does not know
        groups = [g.group for g in detail.groups if sees(name, g.group)]
        now_us = self.clock.wall_us()
        oldest = self.stats.oldest_unacked(name)
        history = self.sampler.history
        partitions: list[dict[str, Any]] = []
        ordered = self.ordered.ordered(name)
        if ordered:
            for group, owners in self.ordered.partition_owners(name).items():
                if group not in groups:
                    continue
                for partition, (consumer, left_s) in owners.items():
                    partitions.append(
                        {
                            "group": group,
                            "partition": partition,
                            "consumer": consumer,
                            "lease_left_s": round(left_s, 3),
                        }
                    )
        seen = self.recent_consumers.recent
        return {
            "subject": name,
            "ordered": ordered,
            "sample_interval_s": self.sampler.interval_s,
            "groups": [
                {
                    "group": group,
                    "oldest_unacked_age_s": _age(now_us, oldest.get(group)),
                    "consumers": [
                        {"consumer": s.consumer, "seen_s_ago": round(s.seconds_ago, 3)}
                        for s in seen(name, group, within_s=RECENT_CONSUMER_S)
                    ],
                }
                for group in groups
            ],
            "history": {
                "at": [rfc3339(int(at * 1_000_000)) for at in history.times()],
                "in_per_s": [_rate(v) for v in history.values(in_key(name))],
                "out_per_s": _summed(
                    [history.values(out_key(name, g)) for g in groups], len(history)
                ),
                "backlog": [
                    {"group": group, "values": _counts(history.values(backlog_key(name, group)))}
                    for group in groups
                ],
            },
            "partitions": partitions,
        }


def _age(now_us: int, stored_us: int | None) -> float | None:
    return None if stored_us is None else round(max(now_us - stored_us, 0) / 1_000_000, 3)


def _total(rates: Any) -> float | None:
    known = [r for r in rates if r is not None]
    return round(sum(known), 3) if known else None


def _counts(values: list[float | None]) -> list[int | None]:
    return [None if v is None else int(v) for v in values]


def _summed(series: list[list[float | None]], samples: int) -> list[float | None]:
    """Sample by sample, the sum of the series that had a value (None where none had)."""
    if not series:
        return [None] * samples
    return [_total(values) for values in zip(*series, strict=True)]
