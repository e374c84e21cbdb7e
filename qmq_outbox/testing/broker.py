"""``InMemoryBroker``: API v1 in memory, served to the real clients through ``httpx.MockTransport``.

A thin façade over its parts, each one concern: ``produce`` (checks, dedup, delayed
messages), ``pulls`` and ``ordered_pulls`` (leases, acks, nacks), ``dead`` (dead letters,
redrive), ``stats``, ``routing`` (ordered subjects' declarations and route changes) and
``longpoll``, all on one shared ``BrokerState``. Requests are checked by the broker's own
rules (``qmq_wire.rules``). Thread-safe: one lock around all state.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import httpx

import qmq_wire as wire
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.testing import http
from qmq_outbox.testing.dead import DeadLetters
from qmq_outbox.testing.failures import PlannedFailures
from qmq_outbox.testing.longpoll import LongPoll, LongPolls
from qmq_outbox.testing.produce import Produce
from qmq_outbox.testing.pulls import Pulls
from qmq_outbox.testing.resets import Resets
from qmq_outbox.testing.routing import RouteChanges
from qmq_outbox.testing.state import BrokerState
from qmq_outbox.testing.stats import Stats
from qmq_wire.delivery import RetryPolicy
from qmq_wire.rules import Refused

BASE_URL = "http://qmq.test"
Answer = dict[str, Any]


class InMemoryBroker:
    """The broker's API v1 for unit tests: produce, pull, ack, nack, dead letters, stats,
    and ordered subjects with their route changes, without command messages or partition
    leases (``qmq_outbox/testing/ordered.py``).

    Use it through the real clients: ``broker.client()`` / ``broker.async_client()``, or
    ``BrokerClient(BASE_URL, transport=broker.transport())``. Same validation, error codes
    and delivery rules as the broker (``docs/architecture.md`` section 3); nothing is
    persisted, dedup never forgets, ``/v1/schedule`` and ``/metrics`` are not served.

    Switches: ``available = False`` answers 503 everywhere; ``lose_responses = n`` handles
    the next n requests and then fails them with a read timeout (the client cannot tell
    whether they happened); ``forbidden_subjects`` rejects produces to them with 403;
    ``fail(operation, code=, times=)`` answers the next requests to one operation with an
    error. Introspection: ``stored`` (every accepted envelope, as sent), ``ids``,
    ``requests``, ``received(operation)``, ``most_leased``, ``acked_seqs``, ``dead_seqs``.
    Operations are named as the clients' methods: ``produce``, ``pull``, ``ack``, ``nack``,
    ``subjects``, ``subject``, ``dead_letters``, ``redrive``, ``reset_group``,
    ``declare_subject``,
    ``routes``, ``split_partition``, ``merge_partitions``, ``move_partition``, and
    ``healthz``.
    """

    def __init__(
        self,
        *,
        ack_timeout: float = wire.DEFAULT_ACK_TIMEOUT_S,
        max_attempts: int = wire.DEFAULT_MAX_ATTEMPTS,
        backoff: Sequence[float] = wire.DEFAULT_BACKOFF_S,
        max_body: int = wire.MAX_BODY_BYTES,
        max_delay: float = wire.DEFAULT_MAX_DELAY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.RLock()
        self._state = BrokerState(
            policy=RetryPolicy(
                ack_timeout_us=int(ack_timeout * 1_000_000),
                max_attempts=max_attempts,
                backoff_s=tuple(backoff),
            ),
            max_body=max_body,
            max_delay_us=int(max_delay * 1_000_000),
            clock=clock,
            wake=self._wake,
        )
        self.available = True
        self.lose_responses = 0
        self.forbidden_subjects: set[str] = set()
        self.requests = 0
        self._received: list[tuple[str, Any]] = []
        self._failures = PlannedFailures()
        self._produce = Produce(self._state, self.forbidden_subjects)
        self._pulls = Pulls(self._state)
        self._dead = DeadLetters(self._state)
        self._stats = Stats(self._state)
        self._routing = RouteChanges(self._state, self._pulls.ordered)
        self._resets = Resets(self._state, self._pulls.ordered)
        self._long_polls = LongPolls(self._lock, self._pulls, self._state.now_us)
        self._handlers: dict[str, Callable[..., Answer | LongPoll]] = {
            "produce": self._produce.produce,
            "pull": self._pulls.pull,
            "ack": self._pulls.ack,
            "nack": self._pulls.nack,
            "subjects": self._stats.subjects,
            "subject": self._stats.subject,
            "declare_subject": self._routing.declare_subject,
            "routes": self._routing.routes,
            "split_partition": self._routing.split_partition,
            "merge_partitions": self._routing.merge_partitions,
            "move_partition": self._routing.move_partition,
            "dead_letters": self._dead.dead_letters,
            "redrive": self._dead.redrive,
            "reset_group": self._resets.reset_group,
            "healthz": lambda params: {"status": "ok"},
        }
        on_advance = getattr(clock, "on_advance", None)
        if on_advance is not None:
            on_advance(self._wake)

    # --- settings, readable as before -------------------------------------------------

    @property
    def policy(self) -> RetryPolicy:
        return self._state.policy

    @property
    def max_body(self) -> int:
        return self._state.max_body

    @property
    def max_delay_us(self) -> int:
        return self._state.max_delay_us

    @property
    def clock(self) -> Callable[[], float]:
        return self._state.clock

    def now_us(self) -> int:
        return self._state.now_us()

    # --- test controls ----------------------------------------------------------------

    def fail(self, operation: str, *, code: str = "recovering", times: int | None = 1) -> None:
        """Answer the next ``times`` requests to ``operation`` with the error ``code``.

        The status follows from the code as on the broker (``qmq_wire.ERROR_STATUS``):
        ``"recovering"`` is 503 (the clients raise ``BrokerUnavailable``), ``"forbidden"``
        403 and ``"unauthorized"`` 401 (``BrokerRejected``). ``times=None``: every request
        from now on; ``times=0``: stop failing. The failed requests change nothing.
        """
        with self._lock:
            self._failures.plan(http.operation(operation), code, times)

    def received(self, operation: str) -> list[Any]:
        """The requests to ``operation`` so far, oldest first: each one's JSON body (the query
        parameters of a GET; None for a body that is not JSON), failed ones included."""
        http.operation(operation)
        with self._lock:
            return [body for name, body in self._received if name == operation]

    def most_leased(self, group: str, consumer: str) -> int:
        """The most messages ``consumer`` of ``group`` held leased at once (over all
        subjects): what a consumer's prefetch bound promises to keep low."""
        with self._lock:
            return self._pulls.most_leased.get((group, consumer), 0)

    def acked_seqs(self, subject: str, group: str, *, partition: int | None = None) -> set[int]:
        """The seqs of ``subject`` (of its ``partition``, if ordered) that ``group`` acked
        (empty until it pulled). For a broadcast group, those acked by any of its consumers."""
        with self._lock:
            owners = self._state.owners(subject, group, partition)
            return {seq for owner in owners for seq in owner.acked}

    def dead_seqs(self, subject: str, group: str, *, partition: int | None = None) -> set[int]:
        """The seqs of ``subject`` (of its ``partition``, if ordered) that are dead letters
        of ``group`` now (redrive takes them out again). For a broadcast group, those of any
        of its consumers."""
        with self._lock:
            owners = self._state.owners(subject, group, partition)
            return {seq for owner in owners for seq in owner.dead}

    @property
    def stored(self) -> list[dict[str, Any]]:
        """Every accepted envelope, as sent (duplicates are not)."""
        return self._produce.stored

    @property
    def ids(self) -> Counter[str]:
        """How many times each message id was accepted (duplicates are not counted)."""
        return Counter(m["id"] for m in self.stored)

    # --- the clients' side --------------------------------------------------------------

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def async_transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle_async)

    def client(self, **options: Any) -> BrokerClient:
        return BrokerClient(BASE_URL, transport=self.transport(), **options)

    def async_client(self, **options: Any) -> AsyncBrokerClient:
        return AsyncBrokerClient(BASE_URL, transport=self.async_transport(), **options)

    def handle(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests += 1
            try:
                answer = self._route(request)
                if isinstance(answer, LongPoll):
                    answer = self._long_polls.wait(answer)
                response = _response(answer)
            except Refused as exc:
                response = _refusal(exc)
            return self._deliver(request, response)

    async def handle_async(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests += 1
            try:
                answer = self._route(request)
            except Refused as exc:
                return self._deliver(request, _refusal(exc))
        if isinstance(answer, LongPoll):
            answer = await self._long_polls.wait_async(answer)
        response = _response(answer)
        with self._lock:
            return self._deliver(request, response)

    def _deliver(self, request: httpx.Request, response: httpx.Response) -> httpx.Response:
        if self.lose_responses > 0:
            self.lose_responses -= 1
            raise httpx.ReadTimeout("response lost", request=request)
        return response

    def _route(self, request: httpx.Request) -> Answer | LongPoll | httpx.Response:
        path = request.url.path
        found = False
        for pattern, method, name in http.ROUTES:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            found = True
            if request.method != method:
                continue  # the same path may take another method (GET and PUT a subject)
            if method != "GET" and http.media_type(request) != "application/json":
                message = "a POST body must be sent as Content-Type: application/json"
                raise Refused("unsupported_media_type", message, "Content-Type")
            doc = http.read(request)
            unreadable = isinstance(doc, http.Unreadable)
            self._received.append((name, None if unreadable else doc))
            if not self.available:
                if name == "healthz":
                    return http.json_response(503, {"status": "recovering"})
                raise Refused("recovering", "the broker is still recovering")
            self._failures.check(name)
            if unreadable:
                raise Refused("invalid_json", f"request body is not valid JSON: {doc.reason}")
            self._state.release_due()
            return self._handlers[name](doc, *match.groups())
        if found:
            raise Refused("method_not_allowed", f"{request.method} is not allowed here")
        raise Refused("not_found", f"no route {path}")

    def _wake(self) -> None:
        self._long_polls.wake()


def _response(answer: Answer | httpx.Response) -> httpx.Response:
    return answer if isinstance(answer, httpx.Response) else http.json_response(200, answer)


def _refusal(exc: Refused) -> httpx.Response:
    return http.json_response(exc.status, wire.error_answer(exc.code, exc.message, exc.field))
