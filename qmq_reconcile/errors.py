"""The reconciliation's exceptions: one root, subclasses by concern.

``BadInput`` and its subclasses are the caller's mistakes (exit code 2 on the CLI): the job
never started, or could not read what it was pointed at.
"""

from __future__ import annotations


class ReconcileError(Exception):
    """The reconciliation failed."""


class BadInput(ReconcileError):
    """An argument of the reconciliation is invalid."""


class BadOutboxUrl(BadInput):
    """An outbox URL is not a database URL the reconciliation can read."""


class UnreadablePath(BadInput):
    """A path given to the reconciliation cannot be read (or, for --out, written)."""


class OutboxUnreadable(BadInput):
    """An outbox database could not be read (unreachable, no ``qmq_outbox`` table, ...)."""


class BrokerDataUnreadable(BadInput):
    """A broker data directory holds a file the format module cannot read."""


class StreamUnreadable(BadInput):
    """A JetStream stream could not be read (server unreachable, no such stream, ...)."""


class ConsumedUnreadable(OutboxUnreadable):
    """A consumer database's ``qmq_consumed`` table could not be read (``--consumed``)."""
