"""Notification consumer in broadcast mode: every instance sees every order event.

    python -m examples.notifications --broker-url http://127.0.0.1:8931 \
        --consumer-id n1 --out n1.log

Each running instance (say one per notification channel) gets every message of the group.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from qmq_outbox import Consumer, Message


def build(broker_url: str, consumer_id: str, out: Path) -> Consumer:
    consumer = Consumer(
        broker_url, "notifications", consumer_id=consumer_id, mode="broadcast", wait_ms=1000
    )
    lock = threading.Lock()

    def notify(message: Message) -> None:
        with lock, out.open("a") as handle:
            handle.write(f"{message.subject} {message.json()['order_id']} {message.id}\n")

    consumer.handler("order.created")(notify)
    consumer.handler("order.cancelled")(notify)
    return consumer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--consumer-id", required=True)
    parser.add_argument("--out", type=Path, required=True, help="where notifications are written")
    args = parser.parse_args()
    build(args.broker_url, args.consumer_id, args.out).run()


if __name__ == "__main__":
    main()
