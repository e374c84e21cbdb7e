"""OpenTelemetry spans with the SDK's in-memory exporter, through a real broker process, a
real ``Outbox`` on SQLite and a real ``Consumer``; and the same flow with OpenTelemetry
impossible to import (in a child process)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session, sessionmaker

from qmq_outbox import Consumer, Message, Outbox, tracing
from qmq_outbox.compensator import Compensator
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.schema import metadata
from tests.integration.consumer_support import running
from tests.support.broker_process import BrokerProcess, free_port
from tests.support.outbox import sqlite_transactions, statuses, wait_for

ABSENT_SCRIPT = Path(__file__).with_name("tracing_absent.py")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker for the module (each test has its own subjects)."""
    process = BrokerProcess(tmp_path_factory.mktemp("tracing") / "broker").start()
    yield process
    process.stop()


@dataclasses.dataclass(frozen=True)
class Recording:
    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def otel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recording]:
    """An SDK provider as the global one for this test only (``set_tracer_provider`` works
    once per process, so the global is patched), its spans kept in memory."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield Recording(provider, exporter)
    provider.shutdown()


def named(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sqlite_transactions(sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def maker(engine: sa.Engine) -> sessionmaker[Session]:
    return sessionmaker(engine)


def subject() -> str:
    return f"orders.{uuid.uuid4().hex[:8]}"


def test_a_message_published_in_a_request_span_is_handled_in_the_same_trace(
    otel: Recording, broker: BrokerProcess, maker: sessionmaker[Session]
) -> None:
    topic = subject()
    with Outbox(broker_url=broker.url, app="shop") as outbox:
        outbox.install(maker)
        request_tracer = otel.provider.get_tracer("shop.web")
        with request_tracer.start_as_current_span("POST /orders") as request, maker.begin() as s:
            outbox.publish(s, topic, {"order_id": 1})
        wait_for(lambda: "qmq send" in [s.name for s in otel.spans()], what="send span")

    seen: list[tuple[trace.SpanContext, dict[str, str]]] = []
    handled = threading.Event()
    consumer = Consumer(broker.url, "billing", wait_ms=200, ack_interval=0.02)

    @consumer.handler(topic)
    def handle(message: Message) -> None:  # a plain handler: it runs on a handler thread
        seen.append((trace.get_current_span().get_span_context(), dict(message.headers)))
        handled.set()

    with running(consumer):
        assert handled.wait(15)

    spans = otel.spans()
    trace_id = request.get_span_context().trace_id
    publish = named(spans, f"qmq publish {topic}")
    assert publish.kind is trace.SpanKind.PRODUCER
    assert publish.parent is not None
    assert publish.parent.span_id == request.get_span_context().span_id
    assert publish.context is not None
    assert publish.context.trace_id == trace_id

    send = named(spans, "qmq send")
    assert send.kind is trace.SpanKind.CLIENT
    assert send.parent is None  # its own trace, linked to what it sent
    assert [link.context.span_id for link in send.links] == [publish.context.span_id]
    assert send.status.status_code is not trace.StatusCode.ERROR

    handle_span = named(spans, f"qmq handle {topic}")
    assert handle_span.kind is trace.SpanKind.CONSUMER
    assert handle_span.context is not None
    assert handle_span.context.trace_id == trace_id
    assert handle_span.parent is not None
    assert handle_span.parent.span_id == publish.context.span_id
    assert handle_span.attributes is not None
    assert handle_span.attributes["messaging.consumer.group.name"] == "billing"

    ((current, headers),) = seen
    assert current.span_id == handle_span.context.span_id  # the handler ran inside it
    assert headers["traceparent"].startswith(f"00-{trace_id:032x}-{publish.context.span_id:016x}-")


def test_a_failing_handler_marks_its_span(
    otel: Recording, broker: BrokerProcess, maker: sessionmaker[Session]
) -> None:
    topic = subject()
    with Outbox(broker_url=broker.url) as outbox:
        outbox.install(maker)
        with maker.begin() as session:
            outbox.publish(session, topic, {"order_id": 2})
    failed = threading.Event()
    consumer = Consumer(broker.url, "billing", wait_ms=200, ack_interval=0.02)

    @consumer.handler(topic)
    async def handle(message: Message) -> None:  # a coroutine: it runs on the loop
        failed.set()
        raise ValueError("no such customer")

    async def run_until_failed() -> None:
        task = asyncio.create_task(consumer.run_async(install_signal_handlers=False))
        await asyncio.to_thread(failed.wait, 15)
        consumer.stop()
        await task

    asyncio.run(run_until_failed())
    handle_span = next(s for s in otel.spans() if s.name == f"qmq handle {topic}")
    assert handle_span.status.status_code is trace.StatusCode.ERROR
    assert handle_span.status.description == "ValueError: no such customer"
    assert [e.name for e in handle_span.events] == ["exception"]


def test_the_compensators_resend_is_linked_to_the_publish_span(
    otel: Recording,
    broker: BrokerProcess,
    maker: sessionmaker[Session],
    engine: sa.Engine,
) -> None:
    topic = subject()
    with Outbox(dispatch=False) as outbox:  # every message is left to the compensator
        outbox.install(maker)
        with maker.begin() as session:
            message_id = outbox.publish(session, topic, {"order_id": 3})
    no_broker = f"http://127.0.0.1:{free_port()}"
    options = {"grace": timedelta(0), "backoff_base": timedelta(0), "backoff_cap": timedelta(0)}
    for url in (no_broker, broker.url):
        comp = Compensator(engine=engine, broker_url=url, **options)  # type: ignore[arg-type]
        comp.run_once()
        assert comp.stop(5)
    assert statuses(engine) == {message_id: "sent"}

    spans = otel.spans()
    publish = named(spans, f"qmq publish {topic}")
    assert publish.context is not None
    failed, resent = [s for s in spans if s.name == "qmq resend"]
    for span in (failed, resent):
        assert span.kind is trace.SpanKind.CLIENT
        assert [link.context.span_id for link in span.links] == [publish.context.span_id]
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert "broker unreachable" in (failed.status.description or "")
    assert resent.status.status_code is not trace.StatusCode.ERROR


def test_without_a_tracer_provider_publish_leaves_the_headers_alone() -> None:
    message = OutgoingMessage(id="m-1", subject="orders", body=b"{}")
    assert tracing.published(message) is message


def test_publish_and_handle_work_when_opentelemetry_cannot_be_imported(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, str(ABSENT_SCRIPT), broker.url, str(tmp_path / "absent.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "handled without opentelemetry"
