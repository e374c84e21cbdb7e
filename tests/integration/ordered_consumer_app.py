"""Ordered consumers for the tests of ordered handlers, in this process or as a child process
(``python -m tests.integration.ordered_consumer_app``, to be killed with SIGKILL).

Their handler appends the message's ``(key, n)`` to the ``ordered_ledger`` table in the
idempotent store's transaction, so the ledger's ids give the order in which each key's
effects committed, and a redelivery that the store skips adds nothing.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message

ledger_tables = sa.MetaData()
ledger = sa.Table(
    "ordered_ledger",
    ledger_tables,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("subject", sa.String(200), nullable=False),
    sa.Column("key", sa.String(64), nullable=False),
    sa.Column("n", sa.Integer, nullable=False),
    sa.Column("partition", sa.Integer, nullable=True),
    sa.Column("consumer", sa.String(200), nullable=False),
)

Handler = Callable[[Message, Session], None]


def recorder(consumer_id: str, before: Callable[[Message], None] | None = None) -> Handler:
    """A store handler that writes the message's ledger row (after ``before``, if given)."""

    def record(message: Message, session: Session) -> None:
        if before is not None:
            before(message)
        body = message.json()
        session.execute(
            sa.insert(ledger).values(
                subject=message.subject,
                key=body["key"],
                n=body["n"],
                partition=message.partition,
                consumer=consumer_id,
            )
        )

    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--consumer-id", required=True)
    parser.add_argument("--started", type=Path, required=True, help="touched at the first row")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")

    engine = sa.create_engine(args.db, pool_size=args.concurrency + 2)
    store = IdempotentStore(sessionmaker(engine))
    consumer = Consumer(
        args.broker,
        args.group,
        consumer_id=args.consumer_id,
        concurrency=args.concurrency,
        wait_ms=200,
        ack_interval=0.02,
    )

    def mark(message: Message) -> None:
        if not args.started.exists():
            args.started.touch()

    consumer.add_handler(
        args.subject, recorder(args.consumer_id, mark), idempotent=store, ordered=True
    )
    consumer.run()


if __name__ == "__main__":
    main()
