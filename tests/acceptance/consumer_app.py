"""A consumer process for the acceptance tests (``python -m tests.acceptance.consumer_app``).

Its handler bills an order (transactional mode) or records an outside effect
(non-transactional mode), drops a marker file ``started-<seq>-<attempt>`` when it starts,
optionally sleeps, and hangs forever on the first attempt of the ``--hang`` seqs so the
test can kill it mid-handler. It runs ``Consumer.run()`` in the main thread, so SIGTERM and
SIGINT stop it gracefully.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, IdempotentStore, Message
from tests.integration.consumer_support import invoices, record_effect


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--markers", type=Path, required=True)
    parser.add_argument(
        "--mode", choices=["transactional", "non_transactional"], default="transactional"
    )
    parser.add_argument("--hang", default="", help="comma-separated seqs that hang on attempt 1")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=0)
    parser.add_argument("--ack-interval", type=float, default=0.02)
    parser.add_argument("--lease", type=float, default=60.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")

    hang = {int(seq) for seq in args.hang.split(",") if seq}
    engine = sa.create_engine(args.db, pool_size=args.concurrency + 2)
    store = IdempotentStore(sessionmaker(engine), lease=timedelta(seconds=args.lease))
    consumer = Consumer(
        args.broker,
        args.group,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        wait_ms=200,
        ack_interval=args.ack_interval,
        ack_batch_size=1000,
        shutdown_timeout=20,
    )

    def started(message: Message) -> None:
        (args.markers / f"started-{message.seq}-{message.attempt}").touch()
        if message.seq in hang and message.attempt == 1:
            threading.Event().wait()  # until killed
        if args.slow:
            time.sleep(args.slow)

    def bill(message: Message, session: Session) -> None:
        session.execute(
            sa.insert(invoices).values(
                order_id=message.json()["order_id"], message_id=message.id, amount=10
            )
        )
        started(message)

    def notify(message: Message) -> None:
        record_effect(engine, message.id, message.attempt)
        started(message)

    if args.mode == "transactional":
        consumer.add_handler(args.subject, bill, idempotent=store)
    else:
        consumer.add_handler(args.subject, notify, idempotent=store.non_transactional())
    (args.markers / "ready").touch()
    consumer.run()
    (args.markers / "stopped").write_text(repr(consumer.stats()))
    engine.dispose()


if __name__ == "__main__":
    main()
