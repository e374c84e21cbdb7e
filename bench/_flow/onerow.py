"""The tax's floor: the same SQLAlchemy transaction plus one outbox-shaped row written
straight through psycopg, with nothing around it (no SDK, no dispatch): the least a
transactional outbox can add, one more statement in the caller's transaction."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from bench._flow.common import System, nothing_else
from bench._flow.plain import PlainService
from qmq_outbox import migrate

ROW_SQL = (
    "INSERT INTO qmq_outbox (message_id, subject, key, headers, body, content_type, producer,"
    " deliver_at, tags, status, attempts, next_attempt_at, created_at)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)


class OneRowService(PlainService):
    def enqueue(self, session: Session, order_id: int) -> None:
        now = datetime.now(UTC)
        row = (str(uuid.uuid4()), "flow.order", None, "{}", b'{"order":%d}' % order_id)
        row += ("application/json", "flow", None, None, "pending", 0, now, now)
        session.connection().connection.driver_connection.execute(ROW_SQL, row)  # type: ignore[union-attr]


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
