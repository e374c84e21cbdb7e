"""The JetStream producer: publish each message with ``Nats-Msg-Id`` = its id, await its PubAck.

JetStream stores a resend of an id within the stream's duplicate window once and answers
it ``duplicate``: that is what makes the compensator's resends harmless here too. Outcomes:
``stored``/``duplicate`` from the PubAck; ``rejected`` for what no retry can fix (a
delayed message, a body over the server's limit); ``transient`` (``BrokerUnavailable``)
for the rest: no PubAck in time, no connection, no stream answering for the subject.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import nats.errors
import nats.js.errors

from qmq_outbox.envelope import OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerRejected, BrokerUnavailable, ConfigurationError
from qmq_outbox.transports import headers
from qmq_outbox.transports.base import Outcome
from qmq_outbox.transports.jetstream.config import JetStreamTransport
from qmq_outbox.transports.jetstream.connection import Connection
from qmq_outbox.transports.jetstream.durables import declare_groups
from qmq_outbox.transports.jetstream.streams import Streams
from qmq_outbox.transports.keyorder import publish_in_key_order

logger = logging.getLogger(__name__)

MSG_ID = "Nats-Msg-Id"
MESSAGE_TOO_LARGE = 10054  # JetStream's err_code: "message size exceeds maximum allowed"
DELAY_UNSUPPORTED = (
    "JetStream (nats-server 2.9) has no scheduled delivery: publish without delay/deliver_at, "
    "or use the qmq broker (docs/transports.md)"
)


def rejected(code: str, message: str) -> BrokerRejected:
    return BrokerRejected(status=None, code=code, message=f"JetStream: {message}")


class JetStreamProducer:
    """An ``AsyncProducer`` on one NATS connection (made on first use, on the caller's loop)."""

    def __init__(self, transport: JetStreamTransport) -> None:
        self.transport = transport
        self.base_url = transport.base_url
        self._connection = Connection(transport)
        self._streams = Streams(transport, self._connection)
        self._declared = not transport.groups

    async def produce(self, messages: Sequence[OutgoingMessage]) -> Sequence[Outcome]:
        if not self._declared:  # before the first publish, so the groups see it
            try:
                await declare_groups(self._connection, self._streams)
            except (BrokerUnavailable, ConfigurationError) as exc:
                return [BrokerUnavailable(str(exc))] * len(messages)
            self._declared = True
        return await publish_in_key_order(messages, self._publish)

    async def _publish(self, message: OutgoingMessage) -> Outcome:
        if message.deliver_at is not None:
            return rejected("delay_not_supported", DELAY_UNSUPPORTED)
        try:
            await self._streams.ensure(message.subject)
            js = await self._connection.jetstream()
        except (BrokerUnavailable, ConfigurationError) as exc:
            return BrokerUnavailable(str(exc))
        envelope = headers.encode(message) | {MSG_ID: message.id}
        try:
            ack = await js.publish(
                message.subject,
                message.body,
                timeout=self.transport.publish_timeout.total_seconds(),
                headers=envelope,
            )
        except nats.js.errors.NoStreamResponseError:
            self._streams.forget(message.subject)  # deleted? made again on the next attempt
            return BrokerUnavailable(
                f"JetStream: no stream answered for subject {message.subject} "
                f"(stream {self.transport.stream_for(message.subject)} deleted, or JetStream down)"
            )
        except nats.errors.MaxPayloadError as exc:
            return rejected("body_too_large", str(exc))
        except nats.js.errors.APIError as exc:
            if exc.err_code == MESSAGE_TOO_LARGE:
                return rejected("body_too_large", str(exc))
            return BrokerUnavailable(f"JetStream refused {message.id} for now: {exc}")
        except (TimeoutError, nats.errors.Error) as exc:
            return BrokerUnavailable(f"JetStream: no PubAck for {message.id}: {exc!r}")
        return ProduceResult(
            id=message.id,
            subject=message.subject,
            status="duplicate" if ack.duplicate else "stored",
            seq=ack.seq,
        )

    async def aclose(self) -> None:
        await self._connection.close()
