"""Real traffic for the console's browser tests: a producer thread sending through the SDK's
``BrokerClient``, and SDK ``Consumer``s running on threads with the handler a test gives."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

from qmq_outbox import Consumer, Message
from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage

_ids = itertools.count()


def message(
    subject: str,
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
    key: str | None = None,
    deliver_at: datetime | None = None,
) -> OutgoingMessage:
    return OutgoingMessage(
        id=f"console-{next(_ids)}",
        subject=subject,
        body=body,
        headers=headers,
        key=key,
        producer="console-tests",
        deliver_at=deliver_at,
    )


def order(
    subject: str, number: int, *, key: str | None = None, deliver_at: datetime | None = None
) -> OutgoingMessage:
    body = f'{{"order_id": {number}, "amount": {10 + number % 90}}}'.encode()
    return message(subject, body, key=key, deliver_at=deliver_at)


def delayed(subject: str, count: int, *, hours: int) -> list[OutgoingMessage]:
    """``count`` orders due in each of the ``hours`` hours after the current one."""
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return [
        order(subject, i, deliver_at=hour + timedelta(hours=1 + i % hours, minutes=i % 60))
        for i in range(count)
    ]


class Producer:
    """Sends ``batch`` orders to each subject every ``every_s`` until stopped."""

    def __init__(
        self,
        client: BrokerClient,
        subjects: list[str],
        *,
        batch: int = 5,
        every_s: float = 0.1,
        keyed: bool = False,
    ) -> None:
        self.client = client
        self.subjects = subjects
        self.batch = batch
        self.every_s = every_s
        self.keyed = keyed
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="console-producer", daemon=True)

    def _run(self) -> None:
        numbers = itertools.count()
        while not self._stop.wait(self.every_s):
            for subject in self.subjects:
                batch = []
                for _ in range(self.batch):
                    n = next(numbers)
                    batch.append(order(subject, n, key=f"customer-{n % 7}" if self.keyed else None))
                self.client.produce(batch)
                self.sent += len(batch)

    def __enter__(self) -> Producer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@contextlib.contextmanager
def consuming(
    broker_url: str,
    group: str,
    subject: str,
    handler: Callable[[Message], object],
    *,
    token: str | None = None,
    consumer_id: str | None = None,
    ordered: bool = False,
) -> Iterator[Consumer]:
    """A ``Consumer`` running ``handler`` on a thread until the block ends."""
    consumer = Consumer(
        broker_url,
        group,
        consumer_id=consumer_id,
        concurrency=2,
        wait_ms=200,
        ack_interval=0.02,
        shutdown_timeout=5,
        token=token,
    )
    consumer.add_handler(subject, handler, ordered=ordered)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run(install_signal_handlers=False)
        except BaseException as exc:  # reported when the block ends
            failures.append(exc)

    thread = threading.Thread(target=run, name=f"console-consumer-{group}", daemon=True)
    thread.start()
    try:
        yield consumer
    finally:
        consumer.stop()
        thread.join(15)
    if failures:
        raise failures[0]
