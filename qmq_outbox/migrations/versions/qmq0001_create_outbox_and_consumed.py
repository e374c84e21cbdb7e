"""Create qmq_outbox and qmq_consumed.

Revision ID: qmq0001
Revises:
Create Date: 2025-01-01 00:00:00

A frozen copy of ``qmq_outbox/schema.py`` at this revision (never import the live schema in
a migration). ``branch_labels`` lets an application pull these revisions into its own
Alembic history through ``version_locations`` instead of the separate version table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "qmq0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("qmq",)
depends_on: str | Sequence[str] | None = None

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "qmq_outbox",
        sa.Column("id", _BigId, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(128), nullable=False),
        sa.Column("subject", sa.String(200), nullable=False),
        sa.Column("key", sa.String(200), nullable=True),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("content_type", sa.String(100), nullable=False),
        sa.Column("producer", sa.String(200), nullable=True),
        sa.Column("deliver_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("claim_token", sa.String(36), nullable=True),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_qmq_outbox")),
        sa.UniqueConstraint("message_id", name=op.f("uq_qmq_outbox_message_id")),
        sa.CheckConstraint(
            "status IN ('pending', 'sent', 'dead')", name=op.f("ck_qmq_outbox_status")
        ),
    )
    op.create_index(
        op.f("ix_qmq_outbox_status_next_attempt_at"), "qmq_outbox", ["status", "next_attempt_at"]
    )
    op.create_index(op.f("ix_qmq_outbox_status_sent_at"), "qmq_outbox", ["status", "sent_at"])

    op.create_table(
        "qmq_consumed",
        sa.Column("consumer_group", sa.String(200), nullable=False),
        sa.Column("message_id", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, server_default="done"),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("consumed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("consumer_group", "message_id", name=op.f("pk_qmq_consumed")),
        sa.CheckConstraint("status IN ('processing', 'done')", name=op.f("ck_qmq_consumed_status")),
    )
    op.create_index(op.f("ix_qmq_consumed_consumed_at"), "qmq_consumed", ["consumed_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_qmq_consumed_consumed_at"), table_name="qmq_consumed")
    op.drop_table("qmq_consumed")
    op.drop_index(op.f("ix_qmq_outbox_status_sent_at"), table_name="qmq_outbox")
    op.drop_index(op.f("ix_qmq_outbox_status_next_attempt_at"), table_name="qmq_outbox")
    op.drop_table("qmq_outbox")
