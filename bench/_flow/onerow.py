"""The tax's floor: the same SQLAlchemy transaction plus one outbox-shaped row written
straight through psycopg, with nothing around it (no SDK, no dispatch): the least a
transactional outbox can add, one more statement in the caller's transaction."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from bench._flow.common import INSERT_ORDER, RolledBack, System, nothing_else, warm
from qmq_outbox import migrate

ROW_SQL = (
    "INSERT INTO qmq_outbox (message_id, subject, key, headers, body, content_type, producer,"
    " deliver_at, tags, status, attempts, next_attempt_at, created_at)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)


class OneRowService:
    def __init__(self, db_url: str, connections: int) -> None:
        self._engine = sa.create_engine(db_url, pool_size=connections)
        self._maker = sessionmaker(self._engine)
        warm(self._engine, connections)

    def transaction(self, order_id: int, *, rollback: bool) -> None:
        with self._maker.begin() as session:
            session.execute(INSERT_ORDER, {"id": order_id, "amount": 1})
            now = datetime.now(UTC)
            row = (str(uuid.uuid4()), "flow.order", None, "{}", b'{"order":%d}' % order_id)
            row += ("application/json", "flow", None, None, "pending", 0, now, now)
            session.connection().connection.driver_connection.execute(ROW_SQL, row)  # type: ignore[union-attr]
            if rollback:
                raise RolledBack

    def close(self) -> None:
        self._engine.dispose()


SYSTEM = System(
    name="onerow",
    title="one raw row",
    install=migrate.upgrade,
    deploy=nothing_else,
    service=lambda db_url, config, connections: OneRowService(db_url, connections),
    worker=None,
    note="one raw row: `with Session.begin()`: the business row and one outbox-shaped row"
    " INSERTed through psycopg's own connection, nothing else (the tax's floor)",
)
