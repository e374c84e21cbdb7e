"""NATS JetStream as a transport (the ``nats`` extra): ``JetStreamTransport``."""

from qmq_outbox.transports.jetstream.config import JetStreamTransport, transport_from_url

__all__ = ["JetStreamTransport", "transport_from_url"]
