"""What the offline check reports: one ``Finding`` per piece of damage, and the findings
shared by its checks (derived files, segment headers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import KIND_DIRS, SegmentKind, read_segment_header

DERIVED = "derived file: --repair rebuilds it"
COSTS = {SegmentKind.ACTIONS: "the group changes in it are lost (acks in it lost: redelivery)"}
"""What losing records of a segment kind other than messages costs."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One piece of damage: where it is, what it is, and what it costs."""

    path: Path
    offset: int
    damage: str
    cost: str
    derived: bool = False  # in an index or checkpoint: --repair rebuilds it from the logs
    unreadable: int = 0  # stored messages whose record this damage makes unreadable (lost)

    def line(self) -> str:
        return f"{self.path} at {self.offset}: {self.damage}; {self.cost}"


def derived(path: Path, offset: int, damage: str, unreadable: str) -> Finding:
    """Damage in an index or checkpoint: ``unreadable`` names what reads as unreadable
    until ``--repair`` rebuilds it from the logs."""
    cost = f"{unreadable} reads as unreadable until then; {DERIVED}" if unreadable else DERIVED
    return Finding(path=path, offset=offset, damage=damage, cost=cost, derived=True)


def header_finding(path: Path, data: bytes, kind: SegmentKind) -> Finding | None:
    """The damage of a segment whose header is unreadable or of another kind, if any."""
    try:
        found = read_segment_header(data, path=str(path))
    except CorruptRecord as exc:
        damage = exc.reason
    else:
        if found is kind:
            return None
        damage = f"a {found.name} segment in the {KIND_DIRS[kind]} directory"
    if kind is SegmentKind.MESSAGES:  # the reader checks frames, not the header
        cost = (
            "its frames are still read by their own CRCs; a broker that scans it on start "
            "(past the checkpoint) refuses to start until it is restored or the broker is "
            f"started with --on-damage skip (qmq broker --data-dir {path.parent.parent} "
            "--on-damage skip)"
        )
    else:
        cost = f"every record in it unreadable; {COSTS[kind]}"
    return Finding(path=path, offset=0, damage=damage, cost=cost)
