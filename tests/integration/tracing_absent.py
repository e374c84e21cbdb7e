"""Run by test_tracing.py as ``python tracing_absent.py BROKER_URL SQLITE_PATH``: publish and
handle one message in a process where ``import opentelemetry`` fails."""

from __future__ import annotations

import sys
import threading

sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # any import of it now fails

import sqlalchemy as sa  # noqa: E402 - after the import is made to fail
from sqlalchemy.orm import sessionmaker  # noqa: E402

from qmq_outbox import Consumer, Message, Outbox, tracing  # noqa: E402
from qmq_outbox.schema import metadata  # noqa: E402


def main(broker_url: str, database: str) -> None:
    assert not tracing.ENABLED
    engine = sa.create_engine(f"sqlite:///{database}")
    metadata.create_all(engine)
    maker = sessionmaker(engine)
    with Outbox(broker_url=broker_url) as outbox:
        outbox.install(maker)
        with maker.begin() as session:
            outbox.publish(session, "orders.absent", {"order_id": 1}, headers={"k": "v"})

    received: list[Message] = []
    consumer = Consumer(broker_url, "billing", wait_ms=200, ack_interval=0.02)

    @consumer.handler("orders.absent")
    def handle(message: Message) -> None:
        received.append(message)
        consumer.stop()

    thread = threading.Thread(target=consumer.run, kwargs={"install_signal_handlers": False})
    thread.start()
    thread.join(30)
    assert [m.headers for m in received] == [{"k": "v"}]  # no traceparent added
    loaded = [name for name, module in sys.modules.items() if "opentelemetry" in name and module]
    assert loaded == [], loaded
    engine.dispose()
    print("handled without opentelemetry")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
