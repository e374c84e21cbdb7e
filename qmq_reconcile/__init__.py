"""Reconciliation of outbox tables with broker logs on Spark (docs/architecture.md, section 7).

    from qmq_reconcile import reconcile
    summary = reconcile(outboxes=["postgresql+psycopg://..."], broker_dirs=["/var/lib/qmq"],
                        out="reconcile-out")

Importing this package needs PySpark (the ``spark`` extra). The names below are imported
on first use: Spark's Python workers import ``qmq_reconcile.datasource`` for every
broker read, and should not pay for SQLAlchemy and the job modules they never run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qmq_reconcile.errors import (
        BadInput,
        BadOutboxUrl,
        BrokerDataUnreadable,
        OutboxUnreadable,
        ReconcileError,
        UnreadablePath,
    )
    from qmq_reconcile.job import Result, reconcile, run
    from qmq_reconcile.transforms import CATEGORIES, CRITICAL

_HOMES = {
    "CATEGORIES": "transforms",
    "CRITICAL": "transforms",
    "BadInput": "errors",
    "BadOutboxUrl": "errors",
    "BrokerDataUnreadable": "errors",
    "OutboxUnreadable": "errors",
    "ReconcileError": "errors",
    "Result": "job",
    "UnreadablePath": "errors",
    "reconcile": "job",
    "run": "job",
}

__all__ = [
    "CATEGORIES",
    "CRITICAL",
    "BadInput",
    "BadOutboxUrl",
    "BrokerDataUnreadable",
    "OutboxUnreadable",
    "ReconcileError",
    "Result",
    "UnreadablePath",
    "reconcile",
    "run",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"qmq_reconcile.{home}"), name)
    globals()[name] = value
    return value
