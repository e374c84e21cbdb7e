"""The reconciliation's acked-order check (``qmq_reconcile.transforms.acked_out_of_order``)
over a stopped broker's data directory, without Spark.

The rows are the ones the reconciliation reads (``qmq_reconcile.readers.decode_broker``,
the same decoder its data source runs); the rule is the transform's, row by row: per
subject, group, state owner and key, a message is acked out of order when a message of
that key stored before it (stored time, then partition and seq) was first acked after it
was first acked. A message the group ever dead-lettered is left out, as are command
messages. The Spark transform itself is tested on the same rule in tests/spark.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from qmq_reconcile.readers import decode_broker


def acked_out_of_order(data_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The messages acked out of order (``message_id``, ``earlier_id`` and the key), and how
    many messages the check judged (keyed, in a partition, acked, never dead)."""
    messages = decode_broker([str(data_dir)], "messages").to_pylist()
    actions = decode_broker([str(data_dir)], "actions").to_pylist()
    first_ack: dict[tuple[Hashable, ...], Any] = {}
    dead: set[tuple[Hashable, ...]] = set()
    for row in actions:
        if row["partition"] is None or row["seq"] is None:
            continue
        owner_seq = (row["subject"], row["partition"], row["group"], row["state"], row["seq"])
        if row["type"] == "dead":
            dead.add(owner_seq)
        elif row["type"] == "ack":
            at = first_ack.get(owner_seq)
            first_ack[owner_seq] = row["at"] if at is None else min(at, row["at"])
    stored = {
        (row["subject"], row["partition"], row["seq"]): row
        for row in messages
        if row["partition"] is not None and row["key"] is not None and not row["command"]
    }
    by_key: dict[tuple[Hashable, ...], list[tuple[Any, ...]]] = defaultdict(list)
    for owner_seq, acked_at in first_ack.items():
        subject, partition, group, state, seq = owner_seq
        message = stored.get((subject, partition, seq))
        if message is None or owner_seq in dead:
            continue
        order = (message["stored_at"], partition, seq)
        by_key[(subject, group, state, message["key"])].append((order, acked_at, message["id"]))
    found: list[dict[str, Any]] = []
    for (subject, group, _, key), rows in by_key.items():
        latest: tuple[Any, str] | None = None
        for _, acked_at, message_id in sorted(rows):
            if latest is not None and latest[0] > acked_at:
                found.append(
                    {"subject": subject, "group": group, "key": key, "message_id": message_id}
                    | {"earlier_id": latest[1]}
                )
            if latest is None or (acked_at, message_id) > latest:
                latest = (acked_at, message_id)
    return found, sum(len(rows) for rows in by_key.values())
