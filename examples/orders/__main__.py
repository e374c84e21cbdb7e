"""Run the orders service on its own: place orders, pay most, cancel the unpaid when due.

python -m examples.orders --database-url sqlite:///orders.db --broker-url http://127.0.0.1:8931

What must run beside it: the broker, and a compensator (``qmq compensator`` with the same
URLs), which sends what the dispatcher could not (docs/outbox.md, "What must run").
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from datetime import timedelta

from examples.orders.service import STATE_SUBJECT, connect, make_service, prepare_database
from qmq_outbox import Consumer, Message, Outbox
from qmq_outbox.client import BrokerClient


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--orders", type=int, default=100)
    parser.add_argument("--rate", type=float, default=20.0, help="orders per second")
    parser.add_argument("--pay-ratio", type=float, default=0.7)
    parser.add_argument(
        "--cancel-after",
        type=float,
        default=5.0,
        help="seconds before an unpaid order is cancelled",
    )
    args = parser.parse_args()

    engine, sessions = connect(args.database_url)
    prepare_database(engine)
    with BrokerClient(args.broker_url) as client:  # the same declaration again is a no-op
        client.declare_subject(STATE_SUBJECT, partitions=2)
    with Outbox(broker_url=args.broker_url, app="orders") as outbox:
        service = make_service(sessions, outbox, cancel_after=timedelta(seconds=args.cancel_after))
        timeouts = Consumer(args.broker_url, "orders-timeouts", wait_ms=1000)

        @timeouts.handler("order.payment_due")
        def on_payment_due(message: Message) -> None:
            if service.cancel_if_unpaid(message.json()["order_id"]):
                print(f"cancelled unpaid order {message.json()['order_id']}")

        runner = threading.Thread(
            target=timeouts.run, kwargs={"install_signal_handlers": False}, name="orders-timeouts"
        )
        runner.start()
        rng = random.Random(1)
        for n in range(args.orders):
            order_id = service.place_order(f"customer-{n % 17}", rng.randint(500, 50_000))
            if rng.random() < args.pay_ratio:
                service.pay_order(order_id)
            time.sleep(1 / args.rate)
        print(f"placed {args.orders} orders; waiting {args.cancel_after:g}s for payment deadlines")
        time.sleep(args.cancel_after + 2)
        timeouts.stop()
        runner.join()
    engine.dispose()


if __name__ == "__main__":
    main()
