"""RabbitMQ as a transport (the ``rabbitmq`` extra): ``RabbitMqTransport``."""

from qmq_outbox.transports.rabbitmq.config import RabbitMqTransport, transport_from_url

__all__ = ["RabbitMqTransport", "transport_from_url"]
