"""Errors a test orders from the in-memory broker: the next n requests to an operation fail."""

from __future__ import annotations

import qmq_wire as wire
from qmq_wire.rules import Refused


class PlannedFailures:
    """Per operation (``"pull"``, ``"ack"``, ...): the error code to answer and how many times
    more (None: until told otherwise). Not thread-safe: the broker calls it under its lock."""

    def __init__(self) -> None:
        self._plans: dict[str, tuple[str, int | None]] = {}

    def plan(self, operation: str, code: str, times: int | None) -> None:
        if code not in wire.ERROR_STATUS and not code.startswith("invalid_"):
            raise ValueError(f"unknown error code {code!r}; see qmq_wire.ERROR_STATUS")
        if times is not None and times < 0:
            raise ValueError("times must be >= 0 (or None: every request)")
        if times == 0:
            self._plans.pop(operation, None)
        else:
            self._plans[operation] = (code, times)

    def check(self, operation: str) -> None:
        """Raise ``Refused`` with the planned error for this request, if one is planned."""
        plan = self._plans.get(operation)
        if plan is None:
            return
        code, times = plan
        if times == 1:
            del self._plans[operation]
        elif times is not None:
            self._plans[operation] = (code, times - 1)
        message = f"the in-memory broker was told to fail this {operation} with {code}"
        raise Refused(code, message)
