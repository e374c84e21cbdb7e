"""Index the pending keyed rows of qmq_outbox by (subject, key, id).

Revision ID: qmq0002
Revises: qmq0001
Create Date: 2026-11-23 13:00:00

Serves per-key order (docs/outbox.md, "Per-key order"): the claim and the dispatcher look
up a key's earlier pending rows. Partial, so unkeyed rows never enter it and sent rows
leave it; a frozen copy of the predicate in ``qmq_outbox/schema.py`` at this revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "qmq0002"
down_revision: str | None = "qmq0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PENDING_KEYED = sa.text("status = 'pending' AND key IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_qmq_outbox_pending_key",
        "qmq_outbox",
        ["subject", "key", "id"],
        postgresql_where=_PENDING_KEYED,
        sqlite_where=_PENDING_KEYED,
    )


def downgrade() -> None:
    op.drop_index("ix_qmq_outbox_pending_key", table_name="qmq_outbox")
