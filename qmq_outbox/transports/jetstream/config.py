"""``JetStreamTransport``: the settings of the NATS JetStream transport, and its names.

Importing this module does not import nats-py; the producer and consumer modules do, when
first used (the ``nats`` extra).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar

from qmq_outbox.errors import ConfigurationError
from qmq_outbox.transports.base import Capabilities, ConsumerSpec
from qmq_outbox.transports.blocking import LoopTransport
from qmq_outbox.transports.topology import Groups, group_pairs

if TYPE_CHECKING:
    from qmq_outbox.calls import StartAt
    from qmq_outbox.transports.jetstream.consumer import JetStreamConsumer
    from qmq_outbox.transports.jetstream.producer import JetStreamProducer

CAPABILITIES = Capabilities(dedup=True, delay=False, ordered=False, broadcast=False)
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_-]")
DURABLE_CHARS = 48  # the readable part of a durable consumer's name


def first_token(subject: str) -> str:
    return subject.split(".", 1)[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JetStreamTransport(LoopTransport):
    """NATS JetStream at ``url`` (``nats://host:port``, comma-separated for a cluster).

    Streams: one per subject prefix (the first dot-separated token): ``order.created`` is
    stored by stream ``<stream_prefix>_ORDER`` with subjects ``order`` and ``order.>``
    (``stream_name`` maps a subject to another name), on ``storage`` with ``replicas``,
    keeping messages for ``retention`` and resends' ids for ``duplicate_window``. They are
    created when missing and checked (storage, subjects) when present.

    Consumers: a durable pull consumer per (group, subject); a pulled message is leased for
    ``lease`` (JetStream's AckWait) and tried at most ``max_attempts`` times; then it goes
    to ``<dead_prefix>.<subject>`` in stream ``<stream_prefix>-DEAD``.

    ``groups`` (subject -> group names) get their durable consumers from the producer before
    its first publish, and from ``declare()``, starting at ``groups_start`` (``latest``:
    what is published from the declaration on); a consumer started later keeps that start.
    """

    kind: ClassVar[str] = "jetstream"
    url: str = "nats://127.0.0.1:4222"
    stream_prefix: str = "QMQ"
    stream_name: Callable[[str], str] | None = None
    storage: str = "file"
    replicas: int = 1
    retention: timedelta = timedelta(hours=72)
    duplicate_window: timedelta = timedelta(hours=1)
    dead_prefix: str = "qmq-dead"
    lease: timedelta = timedelta(seconds=30)
    max_attempts: int = 16
    publish_timeout: timedelta = timedelta(seconds=5)
    connect_timeout: timedelta = timedelta(seconds=2)
    client_name: str = "qmq-outbox"
    groups: Groups = dataclasses.field(default_factory=dict, hash=False)
    groups_start: StartAt = "earliest"

    def __post_init__(self) -> None:
        group_pairs(self.groups)  # names checked when configured, not at the first publish
        if self.groups_start not in ("earliest", "latest"):
            raise ConfigurationError(f"groups_start: earliest or latest, not {self.groups_start!r}")
        if importlib.util.find_spec("nats") is None:
            raise ConfigurationError("the JetStream transport needs qmq-outbox[nats] (nats-py)")
        if self.storage not in ("file", "memory"):
            raise ConfigurationError(f"JetStream storage: file or memory, not {self.storage!r}")
        if self.replicas < 1 or self.max_attempts < 1:
            raise ConfigurationError("JetStream replicas and max_attempts must be >= 1")
        if _NOT_IN_NAMES.search(self.stream_prefix) or not self.stream_prefix:
            raise ConfigurationError(f"stream_prefix {self.stream_prefix!r}: use A-Z a-z 0-9 _ -")

    # -- names -----------------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def stream_for(self, subject: str) -> str:
        """The stream that stores ``subject``."""
        if self.stream_name is not None:
            return self.stream_name(subject)
        return f"{self.stream_prefix}_{first_token(subject).upper()}"

    @property
    def dead_stream(self) -> str:
        """The dead letters' stream (``-``: no subject prefix's stream is named so)."""
        return f"{self.stream_prefix}-DEAD"

    def dead_subject(self, subject: str) -> str:
        return f"{self.dead_prefix}.{subject}"

    def durable_name(self, group: str, subject: str) -> str:
        """The durable consumer of ``group`` on ``subject``: readable, and unique by a hash
        of both (names allow only some characters, so two groups could read alike)."""
        readable = _NOT_IN_NAMES.sub("_", f"{group}__{subject}")[:DURABLE_CHARS]
        digest = hashlib.sha256(f"{group}\0{subject}".encode()).hexdigest()[:12]
        return f"qmq_{readable}_{digest}"

    # -- what it makes ---------------------------------------------------------------------

    def async_producer(self) -> JetStreamProducer:
        from qmq_outbox.transports.jetstream.producer import JetStreamProducer

        return JetStreamProducer(self)

    async def open_consumer(self, spec: ConsumerSpec) -> JetStreamConsumer:
        from qmq_outbox.transports.jetstream.consumer import JetStreamConsumer

        return await JetStreamConsumer.open(self, spec)

    async def _declaring(self) -> list[str]:
        """Make every declared group's stream and durable consumer now (again: harmless)."""
        from qmq_outbox.transports.jetstream.durables import declare_topology

        return await declare_topology(self)

    async def _probing(self) -> None:
        from qmq_outbox.transports.jetstream.connection import probe

        await probe(self)


def transport_from_url(url: str) -> JetStreamTransport:
    """``nats://host:port?stream_prefix=...&lease=30s&...`` (simple fields as options)."""
    from qmq_outbox.transports.urls import split_options

    plain, options = split_options(url, JetStreamTransport)
    return JetStreamTransport(url=plain, **options)
