"""Idempotent consumption: ``IdempotentStore`` and its non-transactional mode."""

from qmq_outbox.idempotent.store import (
    DEFAULT_LEASE,
    DEFAULT_RETENTION,
    ClaimHeld,
    DuplicateMessage,
    IdempotentStore,
    IdempotentStoreError,
    NonTransactional,
    Outcome,
)

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
