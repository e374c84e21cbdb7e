"""Dead letters in memory: ``GET .../dead`` pages through them, ``POST .../dead/redrive``
puts them back for delivery with their attempts counted afresh."""

from __future__ import annotations

from typing import Any

import qmq_wire as wire
from qmq_outbox.testing.logs import rfc3339
from qmq_outbox.testing.state import BrokerState
from qmq_wire import rules


class DeadLetters:
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    def dead_letters(self, params: dict[str, str], subject: str, name: str) -> dict[str, Any]:
        rules.check_name(subject, "subject")
        rules.check_name(name, "group")
        limit = rules.query_integer(
            params, "limit", rules.DEAD_PAGE, default=wire.DEFAULT_DEAD_PAGE
        )
        after = rules.query_integer(params, "after_seq", rules.SEQ, default=None)
        partition = rules.query_integer(params, "partition", rules.PARTITION, default=None)
        log, group = self.state.group(subject, name, partition)
        rows = sorted(
            (seq, key, dead)
            for key, owner in group.owners.items()
            for seq, dead in owner.dead.items()
        )
        if after is not None:
            rows = [row for row in rows if row[0] > after]
        assert limit is not None
        page = rows[:limit]
        messages = self.state.logs[log].messages
        dead: list[wire.DeadLetterJson] = [
            {
                "seq": seq,
                "attempts": letter.attempts,
                "error": letter.error,
                "dead_at": rfc3339(letter.at_us),
                "consumer": key or None,
                "message": messages[seq].to_json(letter.attempts),
            }
            for seq, key, letter in page
        ]
        more = len(rows) > limit
        return {"dead": dead, "next_after_seq": page[-1][0] if page and more else None}

    def redrive(self, doc: Any, subject: str, name: str) -> dict[str, Any]:
        rules.check_name(subject, "subject")
        rules.check_name(name, "group")
        seqs = rules.redrive_seqs(rules.REDRIVE.check(doc))
        _, group = self.state.group(subject, name, doc.get("partition"))
        now = self.state.now_us()
        chosen = None if seqs is None else list(dict.fromkeys(seqs))
        redriven = sum(owner.redrive(chosen, now_us=now) for owner in group.owners.values())
        if redriven:
            self.state.wake()
        return {"redriven": redriven}
