"""Billing consumer: one invoice per order, exactly once, with ``IdempotentStore``.

    python -m examples.billing --database-url sqlite:///billing.db --broker-url http://127.0.0.1:8931

The invoice row and the dedup row commit in one transaction, so a redelivered
``order.created`` (after a crash, a lease expiry or a resend) never bills twice.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from sqlalchemy import Integer, String, UniqueConstraint
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from examples.orders.service import connect
from qmq_outbox import Consumer, IdempotentStore, Message
from qmq_outbox.migrate import upgrade


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    __tablename__ = "invoices"
    __table_args__ = (UniqueConstraint("order_id", name="uq_invoices_order_id_dup_check"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    order_id: Mapped[int] = mapped_column(Integer)
    customer: Mapped[str] = mapped_column(String(100))
    amount_cents: Mapped[int] = mapped_column(Integer)


def prepare_database(engine: Engine) -> None:
    """Create the invoices table and migrate the qmq tables (``qmq_consumed``)."""
    Base.metadata.create_all(engine)
    with engine.begin() as connection:
        upgrade(connection)


def build(broker_url: str, database_url: str, *, consumer_id: str | None = None) -> Consumer:
    engine, sessions = connect(database_url)
    prepare_database(engine)
    store = IdempotentStore(sessions)
    # Acks go out in batches every half second: a crash loses the batch's acks, so its
    # messages come back -- and the idempotent store makes sure they bill only once.
    consumer = Consumer(
        broker_url,
        "billing",
        consumer_id=consumer_id,
        concurrency=4,
        wait_ms=1000,
        ack_interval=0.5,
    )

    @consumer.handler("order.created", idempotent=store)
    def bill(message: Message, session: Session) -> None:
        time.sleep(0.02)  # pretend to talk to a payment provider
        order = message.json()
        session.add(
            Invoice(
                order_id=order["order_id"],
                customer=order["customer"],
                amount_cents=order["amount_cents"],
            )
        )

    return consumer


def write_stats_forever(consumer: Consumer, path: Path, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        write_stats(consumer, path)


def write_stats(consumer: Consumer, path: Path) -> None:
    stats = consumer.stats()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {"processed": stats.processed, "duplicates": stats.duplicates, "pulled": stats.pulled}
        )
    )
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--consumer-id")
    parser.add_argument("--stats-file", type=Path, help="write counters here twice a second")
    args = parser.parse_args()
    consumer = build(args.broker_url, args.database_url, consumer_id=args.consumer_id)
    stop = threading.Event()
    if args.stats_file:
        threading.Thread(
            target=write_stats_forever, args=(consumer, args.stats_file, stop), daemon=True
        ).start()
    consumer.run()  # until SIGTERM/SIGINT: finishes in-flight work and flushes acks
    stop.set()
    if args.stats_file:
        write_stats(consumer, args.stats_file)


if __name__ == "__main__":
    main()
