"""Reconciliation of outbox tables with broker logs on Spark (docs/architecture.md, section 7).

    from spark_reconcile import reconcile
    summary = reconcile(outboxes=["postgresql+psycopg://..."], broker_dirs=["/var/lib/qmq"],
                        out="reconcile-out")

Importing this package needs PySpark (the ``spark`` extra).
"""

from spark_reconcile.errors import (
    BadInput,
    BadOutboxUrl,
    BrokerDataUnreadable,
    OutboxUnreadable,
    ReconcileError,
    UnreadablePath,
)
from spark_reconcile.job import Result, reconcile, run
from spark_reconcile.transforms import CATEGORIES, CRITICAL

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
