"""Service functions of the orders example: each runs in one transaction with its messages.

``place_order`` writes the order and two messages in the same transaction: ``order.created``
now, and ``order.payment_due`` after ``cancel_after`` (a delayed message). If the order is
still unpaid when that message arrives, ``cancel_if_unpaid`` cancels it and publishes
``order.cancelled`` -- again in one transaction with the status change.

Each status change also goes to ``order.state``, an ordered subject (``STATE_SUBJECT``,
declared by whoever runs the broker; docs/architecture.md 3.6) keyed by the order id: a
consumer of it sees one order's ``placed`` before its ``paid`` or ``cancelled``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from examples.orders.models import Base, Order
from qmq_outbox import Outbox
from qmq_outbox.migrate import upgrade


def sqlite_engine(url: str) -> Engine:
    """An engine; SQLite files get WAL and a busy timeout so several processes can share them."""
    engine = create_engine(url, connect_args={"timeout": 30} if url.startswith("sqlite") else {})
    if url.startswith("sqlite"):

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

    return engine


def prepare_database(engine: Engine) -> None:
    """Create the app's tables and migrate the qmq tables (as an app would in its deploy)."""
    Base.metadata.create_all(engine)
    with engine.begin() as connection:
        upgrade(connection)


STATE_SUBJECT = "order.state"


@dataclasses.dataclass
class OrdersService:
    place_order: Callable[[str, int], int]
    pay_order: Callable[[int], bool]
    cancel_if_unpaid: Callable[[int], bool]


def make_service(
    sessions: sessionmaker[Session], outbox: Outbox, *, cancel_after: timedelta
) -> OrdersService:
    @outbox.transactional(sessions)
    def place_order(session: Session, customer: str, amount_cents: int) -> int:
        order = Order(customer=customer, amount_cents=amount_cents, status="placed")
        session.add(order)
        session.flush()  # assigns order.id
        payload = {"order_id": order.id, "customer": customer, "amount_cents": amount_cents}
        outbox.publish(session, "order.created", payload, key=str(order.id))
        state = {"order_id": order.id, "state": "placed"}
        outbox.publish(session, STATE_SUBJECT, state, key=str(order.id))
        outbox.publish(
            session,
            "order.payment_due",
            {"order_id": order.id},
            key=str(order.id),
            delay=cancel_after,
        )
        return order.id

    @outbox.transactional(sessions)
    def pay_order(session: Session, order_id: int) -> bool:
        order = session.get(Order, order_id, with_for_update=True)
        if order is None or order.status != "placed":
            return False
        order.status = "paid"
        outbox.publish(session, "order.paid", {"order_id": order_id}, key=str(order_id))
        state = {"order_id": order_id, "state": "paid"}
        outbox.publish(session, STATE_SUBJECT, state, key=str(order_id))
        return True

    @outbox.transactional(sessions)
    def cancel_if_unpaid(session: Session, order_id: int) -> bool:
        order = session.get(Order, order_id, with_for_update=True)
        if order is None or order.status != "placed":
            return False
        order.status = "cancelled"
        outbox.publish(session, "order.cancelled", {"order_id": order_id}, key=str(order_id))
        state = {"order_id": order_id, "state": "cancelled"}
        outbox.publish(session, STATE_SUBJECT, state, key=str(order_id))
        return True

    return OrdersService(
        place_order=place_order, pay_order=pay_order, cancel_if_unpaid=cancel_if_unpaid
    )


def connect(database_url: str) -> tuple[Engine, sessionmaker[Session]]:
    engine = sqlite_engine(database_url)
    return engine, sessionmaker(engine, expire_on_commit=False)
