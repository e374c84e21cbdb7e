"""OpenTelemetry spans for publishing, sending and handling messages (docs/consumer.md).

When ``opentelemetry-api`` can be imported and a tracer provider is set (the global one, as
OpenTelemetry instrumentations use), the SDK records:

- ``qmq publish <subject>`` (PRODUCER) when ``Outbox.publish`` stages a message, a child of
  the caller's current span; its W3C ``traceparent`` goes into the message's headers unless
  the caller set one;
- ``qmq send`` (the dispatcher) and ``qmq resend`` (the compensator), CLIENT spans of their
  own trace, linked to each message's ``traceparent``;
- ``qmq handle <subject>`` (CONSUMER) around a consumer's handler, a child of the message's
  ``traceparent`` (a batch of several messages is linked to each of them instead).

Without the package (or with no provider set) every helper here does nothing, messages
keep their headers as given, and nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from qmq_wire import MAX_HEADERS

if TYPE_CHECKING:
    from qmq_outbox.envelope import Message, OutgoingMessage
    from qmq_outbox.sending import SendReport

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:
    ENABLED = False
else:
    ENABLED = True
    _PROPAGATOR = TraceContextTextMapPropagator()

TRACEPARENT = "traceparent"
MAX_LINKS = 128  # the SDK's default limit of links per span
SYSTEM = "qmq"


def _tracer() -> trace.Tracer | None:
    """The global provider's tracer; None when OpenTelemetry is absent or not configured."""
    if not ENABLED:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):  # no provider set: stay out of the way
        return None
    return _tracer_of(provider)


@functools.lru_cache(maxsize=4)
def _tracer_of(provider: trace.TracerProvider) -> trace.Tracer:
    return provider.get_tracer("qmq_outbox")


def published(message: OutgoingMessage) -> OutgoingMessage:
    """Record the ``qmq publish`` span of ``message``; returns it with that span's
    ``traceparent`` added to its headers if it had none (and has room for one)."""
    tracer = _tracer()
    if tracer is None:
        return message
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "create",
        "messaging.destination.name": message.subject,
        "messaging.message.id": message.id,
    }
    span = tracer.start_span(
        f"qmq publish {message.subject}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    )
    span.end()
    if TRACEPARENT in message.headers or len(message.headers) + 2 > MAX_HEADERS:
        return message
    headers = dict(message.headers)
    _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
    return dataclasses.replace(message, headers=headers)


def _identity(report: SendReport) -> SendReport:
    return report


@contextlib.contextmanager
def sending(
    name: str, messages: Sequence[OutgoingMessage]
) -> Iterator[Callable[[SendReport], SendReport]]:
    """A ``name`` span around one send of ``messages``, linked to their ``traceparent``s.

    Yields ``traced``: pass it the send's report (``report = traced(send(...))``) so a
    broker that was unavailable or rejected messages marks the span as failed.
    """
    tracer = _tracer()
    if tracer is None:
        yield _identity
        return
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.batch.message_count": len(messages),
    }
    with tracer.start_as_current_span(
        name,
        context=Context(),  # its own trace, not the task's or thread's current one
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
        links=_links(m.headers for m in messages),
    ) as span:

        def traced(report: SendReport) -> SendReport:
            failures = len(report.unsent) + len(report.rejected)
            if failures:
                reason = report.error or report.rejected[0][1]
                span.set_status(trace.StatusCode.ERROR, f"{failures} message(s) not sent: {reason}")
            return report

        yield traced


@contextlib.contextmanager
def handling(subject: str, group: str, messages: Sequence[Message]) -> Iterator[None]:
    """The ``qmq handle <subject>`` span, current while the handler runs."""
    tracer = _tracer()
    if tracer is None:
        yield
        return
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.destination.name": subject,
        "messaging.consumer.group.name": group,
    }
    if len(messages) == 1:
        attributes["messaging.message.id"] = messages[0].id
        parent, links = _PROPAGATOR.extract(messages[0].headers), None
    else:
        attributes["messaging.batch.message_count"] = len(messages)
        parent, links = Context(), _links(m.headers for m in messages)
    with tracer.start_as_current_span(
        f"qmq handle {subject}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    ):
        yield


def record_failure(error: BaseException) -> None:
    """Mark the current span (a handler's) as failed by ``error``."""
    if not ENABLED:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.record_exception(error)
        span.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")


def _links(headers: Iterator[dict[str, str]]) -> list[trace.Link]:
    links = []
    for carrier in headers:
        if TRACEPARENT not in carrier:
            continue
        context = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
        if context.is_valid:
            links.append(trace.Link(context))
            if len(links) == MAX_LINKS:
                break
    return links
