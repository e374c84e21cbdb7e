"""A small application's Alembic files, as docs/outbox.md shows them, for the migration
tests: its env.py (its own metadata, and ``include_object`` so autogenerate leaves the
SDK's tables alone) and its first revision, on a branch of its own."""

APP_ENV = """
from alembic import context
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, pool

from qmq_outbox.migrate import include_object

metadata = MetaData()
Table("orders", metadata, Column("id", Integer, primary_key=True),
      Column("note", String(50), nullable=True))

engine = create_engine(context.config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=metadata,
                      include_object=include_object)
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
"""

APP_FIRST = '''
"""orders"""
import sqlalchemy as sa
from alembic import op

revision = "app0001"
down_revision = None
branch_labels = ("app",)
depends_on = None


def upgrade():
    op.create_table("orders", sa.Column("id", sa.Integer, primary_key=True))


def downgrade():
    op.drop_table("orders")
'''
