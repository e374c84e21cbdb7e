"""Action records: one change of a consumer group's state, as framed in the action log.

A record is ``[u8 action type]`` and a JSON document of its fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from enum import IntEnum
from pathlib import Path
from typing import Any

import orjson

from qmq_broker.errors import CorruptRecord
from qmq_broker.format.files import SegmentKind
from qmq_broker.format.frames import iter_records, record_check


class ActionType(IntEnum):
    GROUP = 1  # a group (or broadcast consumer) first seen: start position and mode
    LEASE = 2  # seqs leased to a consumer with their attempt numbers and deadline
    ACK = 3  # seqs finished
    RETRY = 4  # seqs to be delivered again no earlier than `due`
    DEAD = 5  # seqs moved to dead letters with an error
    REDRIVE = 6  # dead seqs put back for delivery
    RESET = 7  # the cursor moved to `cursor`: leases dropped, retries and dead at or after it


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActionRecord:
    """One change of a consumer group's state, as framed in the action log.

    ``state`` names the state owner: the group itself in shared mode, or one consumer of
    the group in broadcast mode (each broadcast consumer has its own cursor).
    """

    type: ActionType
    at_us: int
    subject: str
    group: str
    state: str = ""
    seqs: tuple[int, ...] = ()
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "t": self.at_us,
            "s": self.subject,
            "g": self.group,
            "q": self.seqs,
        }
        if self.state:
            doc["c"] = self.state
        if self.fields:
            doc["f"] = self.fields
        return bytes([int(self.type)]) + orjson.dumps(doc)

    @classmethod
    def decode(cls, payload: bytes, *, path: str = "?", offset: int = -1) -> ActionRecord:
        try:
            kind = ActionType(payload[0])
            doc = orjson.loads(payload[1:])
            return cls(
                type=kind,
                at_us=int(doc["t"]),
                subject=str(doc["s"]),
                group=str(doc["g"]),
                state=str(doc.get("c", "")),
                seqs=tuple(int(s) for s in doc["q"]),
                fields=dict(doc.get("f", {})),
            )
        except (IndexError, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
            raise CorruptRecord(path=path, offset=offset, reason=str(exc)) from exc


# --- readers for tools (qmq_reconcile, tests) -----------------------------------------


is_action_record = record_check(ActionRecord.decode)
"""A frame check for action-log segments: the payload decodes as an action record."""


def iter_action_records(path: Path) -> Iterator[tuple[int, ActionRecord]]:
    """Every whole action record of a segment file with its offset."""
    return iter_records(path, SegmentKind.ACTIONS, ActionRecord.decode)
