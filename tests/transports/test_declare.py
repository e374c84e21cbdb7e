"""Topology before traffic on the real RabbitMQ and NATS JetStream: a producer that declares
its subjects' groups publishes before any consumer exists, and the consumer started later
gets the message once; ``qmq transport declare`` makes the same queues and durable
consumers, twice harmlessly; a file it cannot use is one line naming the field (exit 2)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from qmq_outbox import Consumer, Message, Outbox, OutgoingMessage
from qmq_outbox.transports.base import Transport
from tests.integration.consumer_support import running, wait_for
from tests.support.outbox import statuses
from tests.transports.kits import Kit

pytestmark = pytest.mark.timeout(90)


class Received:
    """What one group's consumer got, by message id."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        with self._lock:
            self.ids.append(message.id)


def consume(
    kit: Kit, group: str, subject: str, *, until: int, start: str = "earliest"
) -> list[str]:
    """Run ``group``'s consumer until it got ``until`` messages, and a second more (a
    duplicate would come by then); what it got."""
    received = Received()
    consumer = Consumer(
        transport=kit.transport(),
        group=group,
        wait_ms=200,
        ack_interval=0.02,
        start=start,  # type: ignore[arg-type]
    )
    consumer.add_handler(subject, received)
    with running(consumer):
        wait_for(lambda: len(received.ids) >= until, what=f"{until} message(s) for {group}")
        time.sleep(1.0)
    return received.ids


def publish_through_outbox(transport: Transport, engine: Engine, subject: str) -> str:
    outbox = Outbox(transport=transport, app="orders")
    outbox.install(engine)
    try:
        with Session(engine) as session:
            message_id = outbox.publish(session, subject, {"order_id": 7})
            session.commit()
        wait_for(
            lambda: statuses(engine, subject=subject).get(message_id) in ("sent", "dead"),
            what="the row settled",
        )
    finally:
        outbox.close(drain_timeout=10)
        outbox.uninstall(engine)
    assert statuses(engine, subject=subject)[message_id] == "sent"
    return message_id


def produce_plain(kit: Kit, subject: str, name: str) -> str:
    producer = kit.transport().producer()
    try:
        message = OutgoingMessage(id=f"{subject}-{name}", subject=subject, body=b"{}")
        (outcome,) = producer.produce([message])
    finally:
        producer.close()
    assert getattr(outcome, "status", outcome) == "stored"
    return message.id


@pytest.fixture
def cleanup(rabbitmq_kit: Kit) -> Iterator[list[tuple[str, str]]]:
    """(group, subject) pairs whose RabbitMQ queues the test made: deleted after it."""
    made: list[tuple[str, str]] = []
    yield made

    async def delete() -> None:
        from qmq_outbox.transports.rabbitmq.connection import connect

        transport = rabbitmq_kit.transport()
        connection = await connect(transport)  # type: ignore[arg-type]
        try:
            channel = await connection.channel()
            for group, subject in made:
                name = transport.queue_name(group, subject)  # type: ignore[attr-defined]
                for queue in (name, f"{name}.retry", f"{name}.dead"):
                    await channel.queue_delete(queue)
        finally:
            await connection.close()

    rabbitmq_kit.run(delete())


def test_rabbitmq_producer_declares_the_groups_before_its_first_publish(
    rabbitmq_kit: Kit, engine: Engine, cleanup: list[tuple[str, str]]
) -> None:
    subject, group = rabbitmq_kit.subject(), rabbitmq_kit.group()
    cleanup.append((group, subject))
    declaring = dataclasses.replace(rabbitmq_kit.transport(), groups={subject: [group]})  # type: ignore[type-var]
    message_id = publish_through_outbox(declaring, engine, subject)  # no consumer ever ran
    assert consume(rabbitmq_kit, group, subject, until=1) == [message_id]


def test_jetstream_producer_declares_groups_that_start_at_its_first_publish(
    jetstream_kit: Kit, engine: Engine
) -> None:
    """A group starting at ``latest`` gets what the declaring producer published before the
    group's consumer ran, and nothing from before the declaration."""
    subject, group = jetstream_kit.subject(), jetstream_kit.group()
    produce_plain(jetstream_kit, subject, "before")
    declaring = dataclasses.replace(  # type: ignore[type-var]
        jetstream_kit.transport(), groups={subject: [group]}, groups_start="latest"
    )
    message_id = publish_through_outbox(declaring, engine, subject)
    got = consume(jetstream_kit, group, subject, until=1, start="latest")
    assert got == [message_id]


def declare(config: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "qmq_outbox",
            "transport",
            "declare",
            "--config",
            str(config),
            *more,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_declare_command_makes_the_rabbitmq_queues_twice_harmlessly(
    rabbitmq_kit: Kit, tmp_path: Path, cleanup: list[tuple[str, str]]
) -> None:
    subject, billing, shipping = rabbitmq_kit.subject(), rabbitmq_kit.group(), rabbitmq_kit.group()
    cleanup += [(billing, subject), (shipping, subject)]
    config = tmp_path / "topology.toml"
    config.write_text(
        f'url = "{rabbitmq_kit.url()}"\n[groups]\n"{subject}" = ["{billing}", "{shipping}"]\n'
    )
    first = declare(config)
    assert first.returncode == 0, first.stderr
    assert f"declared queue {billing}.{subject} bound to qt{rabbitmq_kit.tag}" in first.stdout
    message_id = produce_plain(rabbitmq_kit, subject, "one")  # routed: the queues exist
    again = declare(config)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    assert consume(rabbitmq_kit, billing, subject, until=1) == [message_id]
    assert consume(rabbitmq_kit, shipping, subject, until=1) == [message_id]


def test_declare_command_makes_the_jetstream_consumers_twice_harmlessly(
    jetstream_kit: Kit, tmp_path: Path
) -> None:
    subject, group = jetstream_kit.subject(), jetstream_kit.group()
    produce_plain(jetstream_kit, subject, "before")  # the stream exists; a latest group skips it
    config = tmp_path / "topology.toml"
    config.write_text(f'start = "latest"\n[groups]\n"{subject}" = ["{group}"]\n')
    first = declare(config, "--broker-url", jetstream_kit.url())
    assert first.returncode == 0, first.stderr
    durable = jetstream_kit.transport().durable_name(group, subject)  # type: ignore[attr-defined]
    assert f"declared consumer {durable} of group {group} on {subject}" in first.stdout
    one = produce_plain(jetstream_kit, subject, "one")
    assert declare(config, "--broker-url", jetstream_kit.url()).returncode == 0
    two = produce_plain(jetstream_kit, subject, "two")
    assert consume(jetstream_kit, group, subject, until=2, start="latest") == [one, two]
    assert _deliver_policy(jetstream_kit, subject, durable) == "new"


def _deliver_policy(kit: Kit, subject: str, durable: str) -> str:
    async def read() -> str:
        from qmq_outbox.transports.jetstream.connection import connect

        transport = kit.transport()
        client = await connect(transport)  # type: ignore[arg-type]
        try:
            stream = transport.stream_for(subject)  # type: ignore[attr-defined]
            info = await client.jetstream().consumer_info(stream, durable)
            policy = info.config.deliver_policy
            return str(getattr(policy, "value", policy))  # nats-py answers the plain string
        finally:
            await client.close()

    return kit.run(read())


AMQP = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f'url = "{AMQP}"\n', "groups: a table of subject"),
        (f'url = "{AMQP}"\n[groups]\n"bad subject" = ["g"]\n', 'groups."bad subject": '),
        (f'url = "{AMQP}"\n[groups]\n"a.b" = "billing"\n', 'groups."a.b": a list of group names'),
        (f'url = "{AMQP}"\n[groups]\n"a.b" = ["ok", "no way"]\n', 'groups."a.b"[1]: '),
        (f'url = "{AMQP}"\nqueues = 1\n[groups]\n"a.b" = ["g"]\n', "queues: unknown key"),
        (
            f'url = "{AMQP}"\nstart = "first"\n[groups]\n"a.b" = ["g"]\n',
            "start: earliest or latest",
        ),
        (f'url = "{AMQP}"\nstart = "latest"\n[groups]\n"a.b" = ["g"]\n', "start: only JetStream"),
        ('[groups]\n"a.b" = ["g"]\n', "url: missing"),
        ('url = 5\n[groups]\n"a.b" = ["g"]\n', "url: a string"),
        ('url = "http://127.0.0.1:8931"\n[groups]\n"a.b" = ["g"]\n', "needs no declaration"),
        ("url = \n", "not TOML"),
    ],
)
def test_a_file_it_cannot_use_is_one_line_and_exit_2(tmp_path: Path, text: str, says: str) -> None:
    config = tmp_path / "topology.toml"
    config.write_text(text)
    done = declare(config)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("qmq transport declare: error: ")
    assert says in done.stderr


def test_bad_group_names_in_code_are_refused_when_configured(rabbitmq_kit: Kit) -> None:
    from qmq_outbox.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"groups\['a.b'\]: 'no way' is not a group"):
        dataclasses.replace(rabbitmq_kit.transport(), groups={"a.b": ["no way"]})  # type: ignore[type-var]
