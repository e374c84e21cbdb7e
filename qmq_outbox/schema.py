"""SQLAlchemy metadata of the SDK's tables (docs/architecture.md, section 4 and 5).

The Alembic revisions in ``qmq_outbox/migrations/`` create exactly this schema; a test
compares them.
Constraint names are fixed by the naming convention so that adapters can map a unique
violation to a domain outcome by name.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# SQLite only autoincrements an INTEGER PRIMARY KEY.
_BigId = BigInteger().with_variant(Integer(), "sqlite")


# The rows that can hold back a later row of their key.
PENDING_KEYED = text("status = 'pending' AND key IS NOT NULL")

outbox_table = Table(
    "qmq_outbox",
    metadata,
    Column("id", _BigId, primary_key=True, autoincrement=True),
    Column("message_id", String(128), nullable=False),
    Column("subject", String(200), nullable=False),
    Column("key", String(200), nullable=True),
    Column("headers", JSON(), nullable=False),
    Column("body", LargeBinary(), nullable=False),
    Column("content_type", String(100), nullable=False),
    Column("producer", String(200), nullable=True),
    Column("deliver_at", DateTime(timezone=True), nullable=True),
    Column("status", String(16), nullable=False, server_default="pending"),
    Column("attempts", Integer(), nullable=False, server_default="0"),
    Column("next_attempt_at", DateTime(timezone=True), nullable=False),
    Column("last_error", Text(), nullable=True),
    Column("claim_token", String(36), nullable=True),
    Column("claimed_until", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("sent_at", DateTime(timezone=True), nullable=True),
    # The message's tags (a JSON list); null: none. Added by revision qmq0003, last so that
    # the table it adds to is the one qmq0001 made.
    Column("tags", JSON(), nullable=True),
    UniqueConstraint("message_id"),
    CheckConstraint("status IN ('pending', 'sent', 'dead')", name="status"),
    # Serves the compensator's claim: pending rows by due time.
    Index("ix_qmq_outbox_status_next_attempt_at", "status", "next_attempt_at"),
    # Serves the retention purge of sent rows.
    Index("ix_qmq_outbox_status_sent_at", "status", "sent_at"),
    # Serves per-key order: a key's pending rows by id (docs/outbox.md, "Per-key order").
    # Partial, so unkeyed rows never touch it and sent rows leave it.
    Index(
        "ix_qmq_outbox_pending_key",
        "subject",
        "key",
        "id",
        postgresql_where=PENDING_KEYED,
        sqlite_where=PENDING_KEYED,
    ),
)

CONSUMED_STATUSES = ("processing", "done")

consumed_table = Table(
    "qmq_consumed",
    metadata,
    Column("consumer_group", String(200), nullable=False),
    Column("message_id", String(128), nullable=False),
    Column("status", String(16), nullable=False, server_default="done"),
    Column("lease_until", DateTime(timezone=True), nullable=True),
    Column("consumed_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("consumer_group", "message_id"),
    CheckConstraint("status IN ('processing', 'done')", name="status"),
    Index("ix_qmq_consumed_consumed_at", "consumed_at"),
)
