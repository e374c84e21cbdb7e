"""Add the tags of a message to qmq_outbox.

Revision ID: qmq0003
Revises: qmq0002
Create Date: 2026-11-28 10:00:00

``publish(..., tags=[...])`` keeps a message's tags on its row until it is sent (a JSON
list, null for none), so the compensator sends them as the in-process path does. Nullable
with no default: existing rows read as untagged and the ALTER rewrites no row.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "qmq0003"
down_revision: str | None = "qmq0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("qmq_outbox", sa.Column("tags", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("qmq_outbox") as batch:  # SQLite drops a column by a copy
        batch.drop_column("tags")
