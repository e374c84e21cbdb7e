"""A consumer process on any transport (``python -m tests.transports.consumer_app``).

It bills orders through ``IdempotentStore`` (transactional mode), drops a marker file
``started-<order>-<attempt>`` when a handler starts, and hangs for ever on the first
attempt of the ``--hang`` orders so the test can kill it mid-handler. ``--broker`` is any
transport URL (its settings in the query string). ``Consumer.run()`` runs in the main
thread, so SIGTERM stops it gracefully.
"""

from __future__ import annotations

import argparse
import logging
import threading

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message
from tests.integration.consumer_support import invoices


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--markers", required=True)
    parser.add_argument("--hang", default="", help="comma-separated orders that hang once")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=0)
    parser.add_argument("--ack-interval", type=float, default=0.02)
    parser.add_argument("--wait-ms", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")

    hang = {order for order in args.hang.split(",") if order}
    engine = sa.create_engine(args.db, pool_size=args.concurrency + 2)
    consumer = Consumer(
        args.broker,
        args.group,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        wait_ms=args.wait_ms,
        ack_interval=args.ack_interval,
        ack_batch_size=1000,
        shutdown_timeout=20,
    )

    def bill(message: Message, session: Session) -> None:
        order = message.json()["order_id"]
        session.execute(sa.insert(invoices).values(order_id=order, message_id=message.id, amount=1))
        with open(f"{args.markers}/started-{order}-{message.attempt}", "w"):
            pass
        if order in hang and message.attempt == 1:
            threading.Event().wait()  # until killed

    consumer.add_handler(args.subject, bill, idempotent=IdempotentStore(sessionmaker(engine)))
    with open(f"{args.markers}/ready", "w"):
        pass
    consumer.run()
    engine.dispose()


if __name__ == "__main__":
    main()
