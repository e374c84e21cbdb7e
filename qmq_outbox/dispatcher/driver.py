"""The settings both drivers share, and the ``Dispatch`` each of them runs."""

from __future__ import annotations

from typing import Generic, TypeVar

from qmq_outbox.dispatcher.core import HOLD_DELAY, MAX_HOLDS, Dispatch
from qmq_outbox.failure_log import DEFAULT_SUMMARY_INTERVAL, client_url
from qmq_outbox.transports.base import AsyncProducer, Producer

DEFAULT_NAME = "qmq-outbox-dispatcher"

Client = TypeVar("Client", Producer, AsyncProducer)


class Driver(Generic[Client]):
    """The settings of both drivers: ``senders`` send at once, named ``<name>-<n>``, each
    with its lane of keyed messages. ``client`` is a transport's producer (a
    ``BrokerClient`` or ``AsyncBrokerClient`` for the qmq broker).

    After a failed send, nothing is sent for ``cooldown`` seconds, doubling with each failure
    in a row up to ``max_cooldown``; meanwhile messages younger than ``retry_for`` seconds
    wait for the next try (0: they go straight to the compensator). An outage is summarised
    in the log every ``outage_summary_interval`` seconds. A keyed message held back by an
    earlier row of its key is tried again after ``hold_delay`` seconds, doubling, up to
    ``max_holds`` times.
    """

    def __init__(
        self,
        client: Client,
        *,
        capacity: int = 10_000,
        batch_size: int = 500,
        senders: int = 2,
        cooldown: float = 1.0,
        max_cooldown: float = 5.0,
        outage_summary_interval: float = DEFAULT_SUMMARY_INTERVAL,
        name: str = DEFAULT_NAME,
        hold_delay: float = HOLD_DELAY,
        max_holds: int = MAX_HOLDS,
        retry_for: float = 0.0,
    ) -> None:
        self._client: Client = client
        self._senders = max(1, senders)
        self._dispatch = Dispatch(
            capacity=capacity,
            batch_size=batch_size,
            cooldown=cooldown,
            max_cooldown=max_cooldown,
            target=client_url(client),
            outage_summary_interval=outage_summary_interval,
            lanes=self._senders,
            hold_delay=hold_delay,
            max_holds=max_holds,
            retry_for=retry_for,
        )
        self._name = name
        self._setup()

    def _setup(self) -> None:
        """The driver's own state."""

    def _sender_name(self, lane: int) -> str:
        return f"{self._name}-{lane + 1}"
