"""Bounded connections: a cap on open connections, a header-read timeout, an idle timeout.

uvicorn's httptools protocol closes a kept-alive connection only after a response, and only
if not a byte arrives: a connection that never sends a complete request head (nothing at
all, or a head one byte at a time) stays open for as long as its peer likes, and nothing
limits how many are open. ``LimitedHttpToolsProtocol`` adds, per connection:

- a **header timeout**: the request head must be complete within ``header_timeout_s`` of
  connecting or of the previous response; the timer is not reset by bytes that trickle in,
  and does not run while a request is being served (a long poll whose head arrived is
  not idle);
- the **idle timeout** (uvicorn's keep-alive timeout): nothing sent for ``idle_timeout_s``
  after a response closes the connection;
- the **connection cap**: a connection accepted while ``max_connections`` are open is
  answered a canned ``503 too_many_connections`` with ``Retry-After: 1`` and closed. It
  costs no parser work: the answer is written at once, the write side is shut, and what the
  peer sends meanwhile is read and dropped until it closes or ``REFUSED_LINGER_S`` ends
  (closing with unread data would reset the connection and could lose the answer);
- **abandoned requests**: when the peer goes away while a request on one of the
  ``cancel_on_disconnect`` paths is still being served, its handler is cancelled, so a long
  poll nobody waits for any more gives back its place in the pull caps at once instead of
  when its ``wait_ms`` runs out.

It also sends each answer in **one write**: uvicorn writes a response's head and its body
separately, which on a socket costs two sends and, to the peer, two segments to read.

It relies on uvicorn's ``HttpToolsProtocol`` internals (``on_headers_complete``,
``on_response_complete``, ``timeout_keep_alive_task``, ``_start_asgi_task``);
``tests/acceptance/test_broker_limits.py`` checks each behaviour on a real broker.
Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
from collections.abc import Callable
from typing import Any, ClassVar

import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

import qmq_wire
from qmq_broker.errors import ConfigError
from qmq_broker.metrics import BrokerMetrics

logger = logging.getLogger(__name__)

REFUSED_LINGER_S = 1.0  # how long a refused connection may stay to read its answer
FD_RESERVE = 1024  # open files kept for everything but client connections (segments, ...)
TIMER_SLACK_S = 0.001  # a timer this close to its deadline counts as due (ms loop clock)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """What one connection may take; ``cancel_on_disconnect`` lists request paths."""

    header_timeout_s: float
    idle_timeout_s: float
    max_connections: int
    cancel_on_disconnect: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ConfigError("--header-timeout and --idle-timeout must be more than 0")
        if self.max_connections < 1:
            raise ConfigError("--max-connections must be at least 1")


class ConnectionTracker:
    """Open connections counted against the cap, and the metrics of those closed early.

    ``on_count`` hears the number of open connections each time it changes (on the loop).
    """

    def __init__(
        self,
        limits: ConnectionLimits,
        *,
        metrics: BrokerMetrics,
        on_count: Callable[[int], None] | None = None,
    ) -> None:
        self.limits = limits
        self.open = 0
        self._metrics = metrics
        self._on_count = on_count
        metrics.connections_open.set_function(lambda: self.open)
        body = orjson.dumps(
            qmq_wire.error_answer(
                "too_many_connections",
                f"the broker has {limits.max_connections} connections open "
                "(--max-connections); retry later",
            )
        )
        self.refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"retry-after: 1\r\n"
            b"connection: close\r\n\r\n" + body
        )

    def admit(self) -> bool:
        """Count a new connection in; False (and counted as refused) at the cap."""
        if self.open >= self.limits.max_connections:
            self._metrics.connections_refused.inc()
            return False
        self.open += 1
        if self._on_count is not None:
            self._on_count(self.open)
        return True

    def left(self) -> None:
        self.open -= 1
        if self._on_count is not None:
            self._on_count(self.open)

    def timed_out(self, reason: str) -> None:
        self._metrics.connections_timed_out.labels(reason).inc()


def protocol_class(tracker: ConnectionTracker) -> type[HttpToolsProtocol]:
    """uvicorn's ``http=`` protocol class that counts its connections in ``tracker``."""

    class Bound(LimitedHttpToolsProtocol):
        pass

    Bound.tracker = tracker
    return Bound


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of its ``tracker`` (module docstring)."""

    tracker: ClassVar[ConnectionTracker]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = self.tracker.limits
        # uvicorn annotates it int; it only goes to loop.call_later, which takes seconds.
        self.timeout_keep_alive = limits.idle_timeout_s  # type: ignore[assignment]
        # one timer per connection, left armed across requests: a request sets or clears
        # the deadline it checks (``_head_due``) instead of cancelling and re-creating it
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_due: float | None = None  # loop time the next request head is due by
        self._refused: asyncio.TimerHandle | None = None
        self._abandonable: tuple[asyncio.Task[Any], RequestResponseCycle] | None = None

    # --- the cap --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.tracker.admit():
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def _refuse(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.write(self.tracker.refusal)
        if transport.can_write_eof():
            transport.write_eof()
        self._refused = self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused is None:
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused is not None:
            self._refused.cancel()
            self.transport.close()
            return
        self._cancel_head_timer()
        self.tracker.left()
        super().connection_lost(exc)
        if self._abandonable is not None:
            task, cycle = self._abandonable
            if not cycle.response_complete:
                task.cancel()  # nobody is waiting for this answer any more

    # --- timeouts -------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        """The next request head is due within the header timeout from now."""
        due = self._head_due = self.loop.time() + self.tracker.limits.header_timeout_s
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(due, self._head_timer_fired)

    def _cancel_head_timer(self) -> None:
        self._head_due = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timer_fired(self) -> None:
        self._head_timer = None
        due = self._head_due
        if due is None:
            return  # a head came in time; the response re-arms the timer
        if due - self.loop.time() > TIMER_SLACK_S:  # it moved on since the timer was armed
            self._head_timer = self.loop.call_at(due, self._head_timer_fired)
            return
        self._head_due = None
        if not self.transport.is_closing():
            self.tracker.timed_out("header")
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._head_due = None  # in time: the timer, still armed, finds nothing due
        super().on_headers_complete()
        cycle = self.cycle
        cycle.transport = _OneWriteAnswers(self.transport, cycle, self.loop)  # type: ignore[assignment]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:
            self._arm_head_timer()  # idle, waiting for the next request head

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.tracker.timed_out("idle")
        super().timeout_keep_alive_handler()

    # --- abandoned requests ---------------------------------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if cycle.scope["path"] in self.tracker.limits.cancel_on_disconnect:
            app = self._cancellable(cycle, app)
        super()._start_asgi_task(cycle, app)

    def _cancellable(self, cycle: RequestResponseCycle, app: Any) -> Any:
        async def run(scope: Any, receive: Any, send: Any) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._abandonable = (task, cycle)
            try:
                await app(scope, receive, send)
            except asyncio.CancelledError:
                if not cycle.disconnected:
                    raise
                # Cancelled because the peer left (connection_lost): a normal end.
            finally:
                self._abandonable = None

        return run


class _OneWriteAnswers:
    """A request cycle's view of its transport: the response head waits for the body.

    uvicorn writes the head when the app sends ``http.response.start``, and the body with
    the next message, which every answer here sends right after. The head is held until
    then (the two go out in one send), or until the loop's next turn should a streamed
    body keep it waiting. Writes before the response starts (``100 Continue``) go at once.
    """

    __slots__ = ("_cycle", "_head", "_held", "_loop", "_transport")

    def __init__(
        self, transport: asyncio.Transport, cycle: RequestResponseCycle,
        loop: asyncio.AbstractEventLoop,
    ) -> None:  # fmt: skip
        self._transport = transport
        self._cycle = cycle
        self._loop = loop
        self._head: bytes | None = None
        self._held = False  # the head has been seen (held or sent)

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif not self._held and self._cycle.response_started:
            self._held = True
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


def fit_to_open_files(max_connections: int) -> int:
    """The connection cap the open-file limit allows, raising the soft limit if it can.

    Beyond the limit ``accept`` fails (EMFILE) and the peer waits in the backlog instead of
    being told no; so the soft limit is raised toward the hard one, and a cap that still
    does not fit is lowered, with a warning.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return max_connections
    fitted = max(soft - FD_RESERVE, 1)
    logger.warning(
        "connection cap lowered to fit the open-file limit",
        extra={
            "action": "broker.connection_cap_lowered",
            "max_connections": max_connections,
            "lowered_to": fitted,
            "open_file_limit": soft,
        },
    )
    return fitted
