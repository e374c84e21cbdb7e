"""The broker's status and the check every request passes before it touches state."""

from __future__ import annotations

import asyncio
import enum

from qmq_broker.errors import StorageError, Unavailable
from qmq_broker.storage.journal import Journal


class BrokerStatus(enum.Enum):
    RECOVERING = "recovering"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


class Lifecycle:
    """recovering -> ready -> stopping | failed; writes also stop when the journal failed."""

    def __init__(self) -> None:
        self.status = BrokerStatus.RECOVERING
        self._journal: Journal | None = None

    def open(self, journal: Journal) -> None:
        self._journal = journal
        self.status = BrokerStatus.READY

    def fail(self) -> None:
        self.status = BrokerStatus.FAILED

    def begin_stop(self) -> None:
        if self.status is BrokerStatus.READY:
            self.status = BrokerStatus.STOPPING

    def require(self, *, write: bool = True) -> None:
        """Raise ``Unavailable`` unless the broker may serve a request (a write, by default)."""
        if self.status is BrokerStatus.RECOVERING or self._journal is None:
            raise Unavailable(code="recovering", message="the broker is still recovering")
        if self.status is BrokerStatus.STOPPING:
            raise Unavailable(code="shutting_down", message="the broker is shutting down")
        if write and (self.status is BrokerStatus.FAILED or self._journal.failed is not None):
            raise Unavailable(code="read_only", message="storage failed; the broker is read-only")


async def durable(commit_point: asyncio.Future[None]) -> None:
    """Wait for a journal commit point; a failed write answers ``storage_failed``."""
    try:
        await commit_point  # the caller's own future: cancelling it leaves the batch be
    except StorageError as exc:
        raise Unavailable(code="storage_failed", message=str(exc)) from exc
