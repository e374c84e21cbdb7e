"""Idempotent consumption: ``IdempotentStore`` and its non-transactional mode."""

from qmq_outbox.errors import ClaimHeld, DuplicateMessage, IdempotentStoreError
from qmq_outbox.idempotent.base import DEFAULT_LEASE, DEFAULT_RETENTION, Outcome
from qmq_outbox.idempotent.claims import NonTransactional
from qmq_outbox.idempotent.store import IdempotentStore

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_RETENTION",
    "ClaimHeld",
    "DuplicateMessage",
    "IdempotentStore",
    "IdempotentStoreError",
    "NonTransactional",
    "Outcome",
]
