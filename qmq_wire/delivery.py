"""When a message is delivered again: the retry policy of a consumer group (pure).

``docs/architecture.md`` section 3.2 is its prose: a lease lasts ``ack_timeout``, a nack
without a delay waits the backoff of its attempt (the last one repeats), and a message out
of attempts is a dead letter. Times are microseconds.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    ack_timeout_us: int
    max_attempts: int
    backoff_s: tuple[float, ...]

    def backoff_us(self, attempt: int) -> int:
        """The wait before retrying after failed attempt number ``attempt`` (1-based)."""
        index = min(max(attempt, 1), len(self.backoff_s)) - 1
        return int(self.backoff_s[index] * 1_000_000)
