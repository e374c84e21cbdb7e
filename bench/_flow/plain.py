"""The tax's baseline: the same SQLAlchemy transaction with no message in it; and the
service of the systems that add a statement or two to it (``enqueue``)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from bench._flow.common import INSERT_ORDER, RolledBack, System, nothing_else, warm


class PlainService:
    """``with Session.begin()``: the business row, then ``enqueue`` (nothing here), then the
    rollback if asked for, after both."""

    def __init__(self, db_url: str, connections: int) -> None:
        self._engine = sa.create_engine(db_url, pool_size=connections)
        self._maker = sessionmaker(self._engine)
        warm(self._engine, connections)

    def transaction(self, order_id: int, *, rollback: bool) -> None:
        with self._maker.begin() as session:
            session.execute(INSERT_ORDER, {"id": order_id, "amount": 1})
            self.enqueue(session, order_id)
            if rollback:
                raise RolledBack

    def enqueue(self, session: Session, order_id: int) -> None:
        """What a subclass adds to the transaction for order ``order_id``."""

    def close(self) -> None:
        self._engine.dispose()


SYSTEM = System(
    name="plain",
    title="no message",
    install=lambda db_url: None,
    deploy=nothing_else,
    service=lambda db_url, config, connections: PlainService(db_url, connections),
    worker=None,
    note="no message: `with Session.begin()`: the business row only (SQLAlchemy, psycopg)",
)
