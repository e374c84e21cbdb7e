"""The action log as the services use it: every group state change is recorded, then applied."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qmq_broker.format.actions import ActionRecord, ActionType
from qmq_broker.groups import GroupTable
from qmq_broker.storage.journal import Journal


class ActionLog:
    """Appends an action record to the journal and applies it to the group table.

    Applying right after the append, with no await in between, keeps group state in log
    order, exactly as recovery rebuilds it; the record is durable at the next commit point.
    """

    def __init__(self, *, journal: Journal, groups: GroupTable) -> None:
        self._journal = journal
        self._groups = groups

    def record(self, record: ActionRecord, *, relaxed: bool = False) -> None:
        """Append and apply; ``relaxed``: a lease, ack or nack (durable per --ack-fsync)."""
        self._journal.append_action(record.encode(), relaxed=relaxed)
        self._groups.apply(record)


def action(
    kind: ActionType,
    *,
    at_us: int,
    subject: str,
    group: str,
    state: str,
    seqs: Iterable[int] = (),
    fields: dict[str, Any] | None = None,
) -> ActionRecord:
    """An action record on one delivery state (a shared group, or a broadcast consumer)."""
    return ActionRecord(
        type=kind,
        at_us=at_us,
        subject=subject,
        group=group,
        state=state,
        seqs=tuple(seqs),
        fields=fields or {},
    )
