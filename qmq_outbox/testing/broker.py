"""``InMemoryBroker``: API v1 in memory, served to the real clients through ``httpx.MockTransport``.

Thread-safe: one lock around all state. A long poll waits on a condition (sync clients) or
an asyncio event (async clients) and re-checks whenever a produce, ack, nack, redrive or
clock step could have made messages available. Ordered subjects are kept simply
(``ordered.py`` says what is left out): each partition is a log of its own, ``subject#p``,
with its own groups' standings, as on the broker.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import heapq
import itertools
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson

import qmq_wire as wire
from qmq_outbox.client import AsyncBrokerClient, BrokerClient
from qmq_outbox.testing.checks import (
    Rejected,
    check_ack,
    check_declare,
    check_merge,
    check_move,
    check_path_name,
    check_produce,
    check_pull,
    check_redrive,
    check_split,
    decode_body,
    int_param,
    micros,
    parse_timestamp,
)
from qmq_outbox.testing.delivery import GroupStanding, RetryPolicy, Standing
from qmq_outbox.testing.failures import PlannedFailures
from qmq_outbox.testing.ordered import OrderedSubject
from qmq_wire.ordered import partition_log, split_partition_log
from qmq_wire.routes import RouteConflict, Routes

BASE_URL = "http://qmq.test"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
Answer = dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Kept:
    """A stored message."""

    seq: int
    id: str
    subject: str
    key: str | None
    headers: dict[str, str]
    body: bytes
    base64: bool
    producer: str | None
    created_at_us: int
    stored_at_us: int
    partition: int | None = None  # of an ordered subject

    def wire(self, attempt: int) -> wire.PulledMessageJson:
        if self.base64:
            body, encoding = base64.b64encode(self.body).decode("ascii"), "base64"
        else:
            body, encoding = self.body.decode("utf-8"), "utf-8"
        answer: wire.PulledMessageJson = {
            "id": self.id,
            "subject": self.subject,
            "seq": self.seq,
            "attempt": attempt,
            "key": self.key,
            "headers": self.headers,
            "body": body,
            "body_encoding": "base64" if encoding == "base64" else "utf-8",
            "producer": self.producer,
            "created_at": _rfc3339(self.created_at_us),
            "stored_at": _rfc3339(self.stored_at_us),
        }
        if self.partition is not None:
            answer["partition"] = self.partition
        return answer


@dataclasses.dataclass(slots=True)
class _Shelf:
    """A subject's stored messages (index = seq) and its dedup table."""

    name: str
    messages: list[_Kept] = dataclasses.field(default_factory=list)
    dedup: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: int = 0

    def stats(self) -> wire.SubjectStatsJson:
        end = len(self.messages)
        return {
            "subject": self.name,
            "messages": end,
            "bytes": self.bytes,
            "first_seq": 0,
            "next_seq": end,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class _Delayed:
    """A message accepted with a future ``deliver_at``, stored when due."""

    envelope: dict[str, Any]
    body: bytes
    created_at_us: int


@dataclasses.dataclass(frozen=True, slots=True)
class _LongPoll:
    subject: str
    group: str
    owner: str
    consumer: str
    limit: int
    deadline: float  # time.monotonic()
    acks: dict[str, Any]  # the answer to the acks the pull carried, merged into its answer
    min_messages: int = 1
    linger_until: float = 0.0  # time.monotonic(); fewer than min_messages are not served before


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
    ``subjects``, ``subject``, ``dead_letters``, ``redrive``, ``declare_subject``,
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
        self.policy = RetryPolicy(
            ack_timeout_us=int(ack_timeout * 1_000_000),
            max_attempts=max_attempts,
            backoff_s=tuple(backoff),
        )
        self.max_body = max_body
        self.max_delay_us = int(max_delay * 1_000_000)
        self.clock = clock
        self.available = True
        self.lose_responses = 0
        self.forbidden_subjects: set[str] = set()
        self.requests = 0
        self.stored: list[dict[str, Any]] = []
        self._received: list[tuple[str, Any]] = []
        self._failures = PlannedFailures()
        self._most_leased: dict[tuple[str, str], int] = {}
        self._shelves: dict[str, _Shelf] = {}  # by log name: a subject, or ``subject#p``
        self._ordered: dict[str, OrderedSubject] = {}
        self._groups: dict[tuple[str, str], GroupStanding] = {}
        self._delayed: dict[tuple[str, str], _Delayed] = {}
        self._due: list[tuple[int, int, str, str]] = []  # (due, order, subject, id)
        self._order = itertools.count()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._wakers: set[Callable[[], None]] = set()
        on_advance = getattr(clock, "on_advance", None)
        if on_advance is not None:
            on_advance(self._wake)

    # --- test controls ----------------------------------------------------------------

    def fail(self, operation: str, *, code: str = "recovering", times: int | None = 1) -> None:
        """Answer the next ``times`` requests to ``operation`` with the error ``code``.

        The status follows from the code as on the broker (``qmq_wire.ERROR_STATUS``):
        ``"recovering"`` is 503 (the clients raise ``BrokerUnavailable``), ``"forbidden"``
        403 and ``"unauthorized"`` 401 (``BrokerRejected``). ``times=None``: every request
        from now on; ``times=0``: stop failing. The failed requests change nothing.
        """
        with self._lock:
            self._failures.plan(_operation(operation), code, times)

    def received(self, operation: str) -> list[Any]:
        """The requests to ``operation`` so far, oldest first: each one's JSON body (the query
        parameters of a GET; None for a body that is not JSON), failed ones included."""
        _operation(operation)
        with self._lock:
            return [body for name, body in self._received if name == operation]

    def most_leased(self, group: str, consumer: str) -> int:
        """The most messages ``consumer`` of ``group`` held leased at once (over all
        subjects): what a consumer's prefetch bound promises to keep low."""
        with self._lock:
            return self._most_leased.get((group, consumer), 0)

    def acked_seqs(self, subject: str, group: str, *, partition: int | None = None) -> set[int]:
        """The seqs of ``subject`` (of its ``partition``, if ordered) that ``group`` acked
        (empty until it pulled). For a broadcast group, those acked by any of its consumers."""
        with self._lock:
            owners = self._owners(subject, group, partition)
            return {seq for owner in owners for seq in owner.acked}

    def dead_seqs(self, subject: str, group: str, *, partition: int | None = None) -> set[int]:
        """The seqs of ``subject`` (of its ``partition``, if ordered) that are dead letters
        of ``group`` now (redrive takes them out again). For a broadcast group, those of any
        of its consumers."""
        with self._lock:
            owners = self._owners(subject, group, partition)
            return {seq for owner in owners for seq in owner.dead}

    def _owners(self, subject: str, group: str, partition: int | None) -> list[Standing]:
        standing = self._groups.get((_log(subject, partition), group))
        return [] if standing is None else list(standing.owners.values())

    # --- the clients' side --------------------------------------------------------------

    @property
    def ids(self) -> Counter[str]:
        """How many times each message id was accepted (duplicates are not counted)."""
        return Counter(m["id"] for m in self.stored)

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
                if isinstance(answer, _LongPoll):
                    answer = self._wait(answer)
                response = answer if isinstance(answer, httpx.Response) else _json(200, answer)
            except Rejected as exc:
                response = _json(exc.status, wire.error_answer(exc.code, exc.message, exc.field))
            return self._deliver(request, response)

    async def handle_async(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests += 1
            try:
                answer = self._route(request)
            except Rejected as exc:
                response = _json(exc.status, wire.error_answer(exc.code, exc.message, exc.field))
                return self._deliver(request, response)
        if isinstance(answer, _LongPoll):
            answer = await self._wait_async(answer)
        response = answer if isinstance(answer, httpx.Response) else _json(200, answer)
        with self._lock:
            return self._deliver(request, response)

    def _deliver(self, request: httpx.Request, response: httpx.Response) -> httpx.Response:
        if self.lose_responses > 0:
            self.lose_responses -= 1
            raise httpx.ReadTimeout("response lost", request=request)
        return response

    # --- routing ------------------------------------------------------------------------

    def _route(self, request: httpx.Request) -> Answer | _LongPoll | httpx.Response:
        path = request.url.path
        found = False
        for pattern, method, name in _ROUTES:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            found = True
            if request.method != method:
                continue  # the same path may take another method (GET and PUT a subject)
            if method != "GET" and _media_type(request) != "application/json":
                message = "a POST body must be sent as Content-Type: application/json"
                raise Rejected(415, "unsupported_media_type", message, "Content-Type")
            doc = _read(request)
            self._received.append((name, None if isinstance(doc, _Unreadable) else doc))
            if not self.available:
                if name == "healthz":
                    return _json(503, {"status": "recovering"})
                raise Rejected(503, "recovering", "the broker is still recovering")
            self._failures.check(name)
            if isinstance(doc, _Unreadable):
                raise Rejected(400, "invalid_json", f"request body is not valid JSON: {doc.reason}")
            self._release_due()
            handler: Callable[..., Answer | _LongPoll] = getattr(self, f"_{name}")
            return handler(doc, *match.groups())
        if found:
            raise Rejected(405, "method_not_allowed", f"{request.method} is not allowed here")
        raise Rejected(404, "not_found", f"no route {path}")

    def _healthz(self, params: dict[str, str]) -> Answer:
        return {"status": "ok"}

    # --- produce ------------------------------------------------------------------------

    def _produce(self, doc: Any) -> Answer:
        envelopes = check_produce(doc)
        for index, envelope in enumerate(envelopes):
            if envelope["subject"] in self.forbidden_subjects:
                field = f"messages[{index}].subject"
                raise Rejected(
                    403, "forbidden", f"may not produce to {envelope['subject']!r}", field
                )
        now = self.now_us()
        accepted = []
        for index, envelope in enumerate(envelopes):
            body = decode_body(envelope, f"messages[{index}].body", self.max_body)
            due = self._due_us(envelope, now, index)
            accepted.append((envelope, body, due, self._partition_of(envelope, index, due)))
        results = [
            self._accept(envelope, body, due, now, partition)
            for envelope, body, due, partition in accepted
        ]
        self._wake()
        return {"results": results}

    def _partition_of(self, envelope: dict[str, Any], index: int, due: int) -> int | None:
        """The partition a message of an ordered subject goes to (None for a plain one)."""
        routes = self._ordered.get(envelope["subject"])
        if routes is None:
            return None
        if due:
            message = f"{routes.name!r} is ordered: its messages cannot be delayed"
            raise Rejected(409, "delay_not_ordered", message, f"messages[{index}].deliver_at")
        key = envelope.get("key")
        if key is None:
            message = f"{routes.name!r} is ordered: every message needs a key"
            raise Rejected(409, "key_required", message, f"messages[{index}].key")
        return routes.partition_of(key)

    def _due_us(self, envelope: dict[str, Any], now: int, index: int) -> int:
        """A future due time, or 0 (deliver now); 400 beyond the longest delay."""
        deliver_at = parse_timestamp(envelope.get("deliver_at"))
        due = micros(deliver_at) if deliver_at is not None else 0
        if due <= now:
            return 0
        if due - now > self.max_delay_us:
            field = f"messages[{index}].deliver_at"
            raise Rejected(400, "delay_too_long", "deliver_at is too far ahead", field)
        return due

    def _accept(
        self, envelope: dict[str, Any], body: bytes, due: int, now: int, partition: int | None
    ) -> wire.ProduceResultJson:
        subject, message_id = envelope["subject"], envelope["id"]
        routes = self._ordered.get(subject)
        # An ordered subject's resend may sit in any partition that held its key.
        held = [partition] if routes is None else routes.holders(envelope["key"])
        for where in held:
            shelf = self._shelves.get(_log(subject, where))
            if shelf is not None and message_id in shelf.dedup:
                return _result(envelope, "duplicate", shelf.dedup[message_id], where)
        if (subject, message_id) in self._delayed:
            return _result(envelope, "duplicate", None, None)
        self.stored.append(envelope)
        if due:
            self._delayed[(subject, message_id)] = _Delayed(envelope, body, now)
            heapq.heappush(self._due, (due, next(self._order), subject, message_id))
            return _result(envelope, "scheduled", None, None)
        seq = self._store(envelope, body, created_default_us=now, now=now, partition=partition)
        return _result(envelope, "stored", seq, partition)

    def _store(
        self,
        envelope: dict[str, Any],
        body: bytes,
        *,
        created_default_us: int,
        now: int,
        partition: int | None = None,
    ) -> int:
        shelf = self._shelf(_log(envelope["subject"], partition))
        created = parse_timestamp(envelope.get("created_at"))
        kept = _Kept(
            seq=len(shelf.messages),
            id=envelope["id"],
            subject=envelope["subject"],
            key=envelope.get("key"),
            headers=dict(envelope.get("headers") or {}),
            body=body,
            base64=envelope.get("body_encoding") == "base64",
            producer=envelope.get("producer"),
            created_at_us=micros(created) if created is not None else created_default_us,
            stored_at_us=now,
            partition=partition,
        )
        shelf.messages.append(kept)
        shelf.dedup[kept.id] = kept.seq
        shelf.bytes += len(body)
        return kept.seq

    def _release_due(self) -> None:
        """Store the delayed messages whose time came, in due order."""
        now = self.now_us()
        while self._due and self._due[0][0] <= now:
            _, _, subject, message_id = heapq.heappop(self._due)
            delayed = self._delayed.pop((subject, message_id))
            self._store(
                delayed.envelope, delayed.body, created_default_us=delayed.created_at_us, now=now
            )

    def _shelf(self, name: str) -> _Shelf:
        shelf = self._shelves.get(name)
        if shelf is None:
            shelf = self._shelves[name] = _Shelf(name)
        return shelf

    # --- pull, ack, nack --------------------------------------------------------------------

    def _pull(self, doc: Any) -> Answer | _LongPoll:
        pull = check_pull(doc)
        subject, name, consumer, mode = (
            pull["subject"],
            pull["group"],
            pull["consumer"],
            pull["mode"],
        )
        if mode == "ordered" or subject in self._ordered:
            return self._pull_ordered(pull)
        group = self._groups.get((subject, name))
        if group is not None and group.mode != mode:
            message = f"group {name!r} on {subject!r} is in {group.mode} mode"
            raise Rejected(409, "mode_conflict", message, "mode")
        if group is None:
            group = self._groups[(subject, name)] = GroupStanding(name, mode)
        owner = group.owner_key(consumer)
        if owner not in group.owners:
            shelf = self._shelf(subject)
            group.owners[owner] = Standing(len(shelf.messages) if pull["start"] == "latest" else 0)
        deadline = time.monotonic() + pull["wait_ms"] / 1000
        acks = {} if pull.get("ack") is None else self._apply_acks({**pull, "seqs": pull["ack"]})
        linger_until = time.monotonic() + min(pull["linger_ms"], pull["wait_ms"]) / 1000
        poll = _LongPoll(
            subject, name, owner, consumer, pull["max"], deadline, acks, pull["min"], linger_until
        )
        messages = self._lease(poll)
        if messages or pull["wait_ms"] == 0:
            return {"messages": messages, **acks}
        return poll

    def _pull_ordered(self, pull: dict[str, Any]) -> Answer | _LongPoll:
        """An ordered pull: its group joins every partition at its first pull."""
        subject, name = pull["subject"], pull["group"]
        routes = self._ordered.get(subject)
        if routes is None:
            message = f"{subject!r} is not ordered: pull it in shared or broadcast mode"
            raise Rejected(409, "not_ordered", message, "mode")
        if pull["mode"] != "ordered":
            raise Rejected(
                409, "mode_conflict", f"{subject!r} is ordered: pull it in ordered mode", "mode"
            )
        if pull.get("ack") is not None:
            message = f"{subject!r} is ordered: ack with POST /v1/ack naming the partition"
            raise Rejected(409, "partition_required", message, "ack")
        if (routes.logs()[0][1], name) not in self._groups:  # joins: every partition now
            for _, log in routes.logs():
                self._ordered_owner(log, name, latest=pull["start"] == "latest")
        deadline = time.monotonic() + pull["wait_ms"] / 1000
        poll = _LongPoll(subject, name, "", pull["consumer"], pull["max"], deadline, {})
        messages = self._lease(poll)
        if messages or pull["wait_ms"] == 0:
            return {"messages": messages}
        return poll

    def _lease(self, poll: _LongPoll) -> list[wire.PulledMessageJson]:
        routes = self._ordered.get(poll.subject)
        if routes is not None:
            return self._lease_ordered(poll, routes)
        self._release_due()
        now = self.now_us()
        owner = self._groups[(poll.subject, poll.group)].owners[poll.owner]
        owner.expire(now_us=now, policy=self.policy)
        shelf = self._shelves[poll.subject]
        if poll.min_messages > 1 and time.monotonic() < poll.linger_until:
            ready = owner.ready(end_seq=len(shelf.messages), now_us=now)
            if ready < poll.min_messages:
                return []  # waits for a fuller batch until linger_until
        chosen = owner.lease(
            consumer=poll.consumer,
            limit=poll.limit,
            end_seq=len(shelf.messages),
            now_us=now,
            policy=self.policy,
        )
        if chosen:
            self._note_leased(poll.group, poll.consumer, now)
        return [shelf.messages[seq].wire(attempt) for seq, attempt in chosen]

    def _lease_ordered(
        self, poll: _LongPoll, routes: OrderedSubject
    ) -> list[wire.PulledMessageJson]:
        """The next batch of each partition that has nothing in flight, up to the limit."""
        now = self.now_us()
        served: list[wire.PulledMessageJson] = []
        for _, log in routes.logs():
            self._ordered_owner(log, poll.group).expire(now_us=now, policy=self.policy)
        for _, log in routes.open_for(lambda p: self._finished(routes, p, poll.group)):
            if len(served) >= poll.limit:
                break
            owner = self._ordered_owner(log, poll.group)
            shelf = self._shelves[log]
            chosen = owner.lease_in_order(
                consumer=poll.consumer,
                limit=poll.limit - len(served),
                end_seq=len(shelf.messages),
                now_us=now,
                policy=self.policy,
                hold_on_dead=routes.on_dead == "block",
            )
            served.extend(shelf.messages[seq].wire(attempt) for seq, attempt in chosen)
        if served:
            self._note_leased(poll.group, poll.consumer, now)
        return served

    def _note_leased(self, group: str, consumer: str, now_us: int) -> None:
        """Keep the peak of the live leases ``consumer`` holds in ``group``, all subjects."""
        held = sum(
            1
            for (_, name), standing in self._groups.items()
            if name == group
            for owner in standing.owners.values()
            for lease in owner.leases.values()
            if lease.consumer == consumer and lease.deadline_us > now_us
        )
        key = (group, consumer)
        self._most_leased[key] = max(self._most_leased.get(key, 0), held)

    def _wait(self, poll: _LongPoll) -> Answer:
        """Long-poll on the calling thread (the lock is held; ``wait`` releases it)."""
        while (timeout := self._timeout(poll)) is not None:
            self._changed.wait(timeout)
            messages = self._lease(poll)
            if messages:
                return {"messages": messages, **poll.acks}
        return {"messages": [], **poll.acks}

    async def _wait_async(self, poll: _LongPoll) -> Answer:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(event.set)

        with self._lock:
            self._wakers.add(wake)
        try:
            while True:
                with self._lock:
                    timeout = self._timeout(poll)
                if timeout is None:
                    return {"messages": [], **poll.acks}
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout)
                event.clear()
                with self._lock:
                    messages = self._lease(poll)
                if messages:
                    return {"messages": messages, **poll.acks}
        finally:
            with self._lock:
                self._wakers.discard(wake)

    def _timeout(self, poll: _LongPoll) -> float | None:
        """Seconds to wait before looking again; None once the long poll ran out."""
        remaining = poll.deadline - time.monotonic()
        if remaining <= 0:
            return None
        times = [t for t in (*self._owners_due(poll), self._due[0][0] if self._due else None) if t]
        if times:
            remaining = min(remaining, max((min(times) - self.now_us()) / 1_000_000, 0.001))
        lingering = poll.linger_until - time.monotonic()
        if lingering > 0:
            remaining = min(remaining, lingering)
        return remaining

    def _owners_due(self, poll: _LongPoll) -> list[int | None]:
        """When a lease of the poll's group expires or a retry comes due, per state owner."""
        routes = self._ordered.get(poll.subject)
        if routes is None:
            return [self._groups[(poll.subject, poll.group)].owners[poll.owner].next_due_us()]
        logs = [log for _, log in routes.logs()]
        return [self._ordered_owner(log, poll.group).next_due_us() for log in logs]

    def _ordered_owner(self, log: str, group: str, *, latest: bool = False) -> Standing:
        """A group's state on an ordered subject's partition, made at its start (``latest``:
        its end) when first needed: a partition a split made later starts empty."""
        standing = self._groups.get((log, group))
        if standing is None:
            standing = self._groups[(log, group)] = GroupStanding(group, "ordered")
        owner = standing.owners.get("")
        if owner is None:
            shelf = self._shelf(log)  # made with the state, as the broker makes the log
            owner = standing.owners[""] = Standing(len(shelf.messages) if latest else 0)
        return owner

    def _finished(self, routes: OrderedSubject, partition: int, group: str) -> bool:
        """Whether ``group`` is done with closed ``partition``: everything in it handled
        (dead letters too, unless the subject blocks on them). Closed partitions take no
        more messages, so the broker's command message would come next."""
        if partition not in routes.routes.closed():
            return False
        log = partition_log(routes.name, partition)
        owner = self._ordered_owner(log, group)
        return (
            owner.cursor >= len(self._shelf(log).messages)
            and not owner.leases
            and not owner.retries
            and (routes.on_dead == "skip" or not owner.dead)
        )

    def _wake(self) -> None:
        with self._lock:
            self._changed.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def _log_of(self, subject: str, partition: int | None) -> str:
        """The log an ack, nack or dead-letter call is about: an ordered subject's partition
        must be named, a plain subject's must not."""
        if subject in self._ordered:
            if partition is None:
                message = f"{subject!r} is ordered: name the partition"
                raise Rejected(409, "partition_required", message, "partition")
            return partition_log(subject, partition)
        if partition is not None:
            message = f"{subject!r} is not ordered: it has no partitions"
            raise Rejected(409, "not_ordered", message, "partition")
        return subject

    def _owner(self, doc: dict[str, Any]) -> Standing:
        name, consumer = doc["group"], doc["consumer"]
        subject = self._log_of(doc["subject"], doc.get("partition"))
        group = self._groups.get((subject, name))
        if group is None:
            raise Rejected(404, "group_not_found", f"no group {name!r} on {subject!r}", "group")
        owner = group.owners.get(group.owner_key(consumer))
        if owner is None:
            message = f"consumer {consumer!r} has not pulled from broadcast group {name!r}"
            raise Rejected(404, "consumer_not_found", message, "consumer")
        return owner

    def _ack(self, doc: Any) -> Answer:
        answer = self._apply_acks(check_ack(doc))
        if answer["acked"] and doc["subject"] in self._ordered:
            self._wake()  # the partition's next batch may be served now
        return answer

    def _apply_acks(self, doc: dict[str, Any]) -> Answer:
        """Ack a checked ``{subject, group, consumer, seqs}`` (an ack, or a pull's acks)."""
        owner = self._owner(doc)
        unique = list(dict.fromkeys(doc["seqs"]))
        known = [seq for seq in unique if owner.holds(seq, doc["consumer"])]
        owner.ack(known)
        return {"acked": len(known), "unknown": [seq for seq in unique if seq not in known]}

    def _nack(self, doc: Any) -> Answer:
        owner = self._owner(check_ack(doc, nack=True))
        delay_ms = doc.get("delay_ms")
        retrying, dead = owner.nack(
            list(dict.fromkeys(doc["seqs"])),
            consumer=doc["consumer"],
            now_us=self.now_us(),
            delay_us=delay_ms * 1000 if delay_ms is not None else None,
            error=doc.get("error"),
            policy=self.policy,
        )
        if retrying or dead:
            self._wake()
        return {"retrying": retrying, "dead": dead}

    # --- dead letters and stats ---------------------------------------------------------------

    def _group(self, subject: str, name: str, partition: int | None) -> tuple[str, GroupStanding]:
        """The log of ``subject`` (its ``partition``'s, if ordered) and ``name``'s group there."""
        if subject not in self._shelves and subject not in self._ordered:
            raise Rejected(404, "subject_not_found", f"no subject {subject!r}", "subject")
        log = self._log_of(subject, partition)
        group = self._groups.get((log, name))
        if group is None:
            raise Rejected(404, "group_not_found", f"no group {name!r} on {log!r}", "group")
        return log, group

    def _dead_letters(self, params: dict[str, str], subject: str, name: str) -> Answer:
        check_path_name(subject, "subject")
        check_path_name(name, "group")
        limit = int_param(
            params, "limit", default=wire.DEFAULT_DEAD_PAGE, low=1, high=wire.MAX_DEAD_PAGE
        )
        after = int_param(params, "after_seq", default=None, low=0, high=wire.MAX_SEQ)
        partition = int_param(
            params, "partition", default=None, low=0, high=wire.MAX_PARTITION_NUMBER
        )
        log, group = self._group(subject, name, partition)
        rows = sorted(
            (seq, key, dead)
            for key, owner in group.owners.items()
            for seq, dead in owner.dead.items()
        )
        if after is not None:
            rows = [row for row in rows if row[0] > after]
        assert limit is not None
        page = rows[:limit]
        shelf = self._shelves[log]
        dead: list[wire.DeadLetterJson] = [
            {
                "seq": seq,
                "attempts": buried.attempts,
                "error": buried.error,
                "dead_at": _rfc3339(buried.at_us),
                "consumer": key or None,
                "message": shelf.messages[seq].wire(buried.attempts),
            }
            for seq, key, buried in page
        ]
        more = len(rows) > limit
        return {"dead": dead, "next_after_seq": page[-1][0] if page and more else None}

    def _redrive(self, doc: Any, subject: str, name: str) -> Answer:
        check_path_name(subject, "subject")
        check_path_name(name, "group")
        seqs = check_redrive(doc)
        _, group = self._group(subject, name, doc.get("partition"))
        now = self.now_us()
        chosen = None if seqs is None else list(dict.fromkeys(seqs))
        redriven = sum(owner.redrive(chosen, now_us=now) for owner in group.owners.values())
        if redriven:
            self._wake()
        return {"redriven": redriven}

    def _subjects(self, params: dict[str, str]) -> Answer:
        """Every subject; an ordered one with its partitions' counters summed."""
        listed: dict[str, wire.SubjectStatsJson] = {}
        for name in sorted(self._shelves):
            subject, partition = split_partition_log(name)
            stats = self._shelves[name].stats()
            if partition is None:
                listed[name] = stats
            elif subject in listed:
                listed[subject] = _summed(listed[subject], stats)
            else:
                listed[subject] = {**stats, "subject": subject, "first_seq": 0}
        for subject in self._ordered:  # declared, nothing stored or pulled yet
            listed.setdefault(subject, _Shelf(subject).stats())
        return {"subjects": [listed[name] for name in sorted(listed)]}

    def _subject(self, params: dict[str, str], name: str) -> Answer:
        check_path_name(name, "subject")
        routes = self._ordered.get(name)
        if routes is not None:
            return self._ordered_subject(routes)
        delayed = [d for (subject, _), d in self._delayed.items() if subject == name]
        shelf = self._shelves.get(name)
        if shelf is None and not delayed:
            raise Rejected(404, "subject_not_found", f"no subject {name!r}", "subject")
        shelf = shelf or _Shelf(name)
        groups = sorted((g.name, g) for (s, _), g in self._groups.items() if s == name)
        return {
            **shelf.stats(),
            "scheduled": {
                "messages": len(delayed),
                "bytes": sum(len(d.body) for d in delayed),
                "unreadable": 0,
            },
            "groups": [group.stats(len(shelf.messages)) for _, group in groups],
        }

    def _ordered_subject(self, routes: OrderedSubject) -> Answer:
        """An ordered subject's counters and each group's, its partitions' summed."""
        total = _Shelf(routes.name).stats()
        groups: dict[str, dict[str, int | str]] = {}
        for _, log in routes.logs():
            shelf = self._shelves.get(log)
            if shelf is None:
                continue
            total = _summed(total, shelf.stats())
            for (where, name), group in self._groups.items():
                if where != log:
                    continue
                stats = group.stats(len(shelf.messages))
                found = groups.get(name)
                groups[name] = stats if found is None else _group_summed(found, stats)
        return {
            **total,
            "scheduled": {"messages": 0, "bytes": 0, "unreadable": 0},
            "groups": [groups[name] for name in sorted(groups)],
        }

    # --- ordered subjects: declaring and routes -------------------------------------------

    def _declare_subject(self, doc: Any, subject: str) -> Answer:
        check_path_name(subject, "subject")
        partitions, on_dead = check_declare(doc)
        found = self._ordered.get(subject)
        if found is not None:
            if (found.partitions, found.on_dead) != (partitions, on_dead):
                message = (
                    f"{subject!r} is ordered with {found.partitions} partitions "
                    f"and on_dead {found.on_dead!r}"
                )
                raise Rejected(409, "subject_conflict", message, "partitions")
            return dict(self._routes_document(found))
        if subject in self._shelves or any(s == subject for s, _ in self._delayed):
            message = f"{subject!r} already holds or served messages unordered"
            raise Rejected(409, "subject_conflict", message, "subject")
        declared = OrderedSubject.create(subject, partitions=partitions, on_dead=on_dead)
        self._ordered[subject] = declared
        return dict(self._routes_document(declared))

    def _routes(self, params: dict[str, str], subject: str) -> Answer:
        return dict(self._routes_document(self._declared(subject)))

    def _split_partition(self, doc: Any, subject: str) -> Answer:
        partition, at = check_split(doc)
        return self._change(subject, lambda routes: routes.split(partition, at))

    def _merge_partitions(self, doc: Any, subject: str) -> Answer:
        partitions = check_merge(doc)
        return self._change(subject, lambda routes: routes.merge(partitions))

    def _move_partition(self, doc: Any, subject: str) -> Answer:
        partition = check_move(doc)
        return self._change(subject, lambda routes: routes.move(partition))

    def _change(self, subject: str, change: Callable[[Routes], Routes]) -> Answer:
        """A route change: the next version, refused (409) when it breaks a rule."""
        try:
            changed = self._declared(subject).changed(change)
        except RouteConflict as exc:
            raise Rejected(409, "route_conflict", exc.message, exc.field) from None
        self._ordered[subject] = changed
        self._wake()  # a group may move on at once (nothing was left in the closed one)
        return dict(self._routes_document(changed))

    def _declared(self, subject: str) -> OrderedSubject:
        """An ordered subject (404 for an unknown one, 409 for a plain one)."""
        check_path_name(subject, "subject")
        routes = self._ordered.get(subject)
        if routes is not None:
            return routes
        if subject in self._shelves:
            raise Rejected(409, "not_ordered", f"{subject!r} is not ordered", "subject")
        raise Rejected(404, "subject_not_found", f"no subject {subject!r}", "subject")

    def _routes_document(self, routes: OrderedSubject) -> wire.RoutesAnswerJson:
        logs = {log for _, log in routes.logs()}
        groups = sorted({name for log, name in self._groups if log in logs})
        return routes.document({group: self._group_version(routes, group) for group in groups})

    def _group_version(self, routes: OrderedSubject, group: str) -> int:
        return routes.routes.group_version(lambda p: self._finished(routes, p, group))

    def now_us(self) -> int:
        return round(self.clock() * 1_000_000)


_ROUTES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"/v1/messages"), "POST", "produce"),
    (re.compile(r"/v1/pull"), "POST", "pull"),
    (re.compile(r"/v1/ack"), "POST", "ack"),
    (re.compile(r"/v1/nack"), "POST", "nack"),
    (re.compile(r"/v1/subjects"), "GET", "subjects"),
    (re.compile(r"/v1/subjects/([^/]+)"), "GET", "subject"),
    (re.compile(r"/v1/subjects/([^/]+)"), "PUT", "declare_subject"),
    (re.compile(r"/v1/subjects/([^/]+)/routes"), "GET", "routes"),
    (re.compile(r"/v1/subjects/([^/]+)/partitions/split"), "POST", "split_partition"),
    (re.compile(r"/v1/subjects/([^/]+)/partitions/merge"), "POST", "merge_partitions"),
    (re.compile(r"/v1/subjects/([^/]+)/partitions/move"), "POST", "move_partition"),
    (re.compile(r"/v1/subjects/([^/]+)/groups/([^/]+)/dead"), "GET", "dead_letters"),
    (re.compile(r"/v1/subjects/([^/]+)/groups/([^/]+)/dead/redrive"), "POST", "redrive"),
    (re.compile(r"/healthz"), "GET", "healthz"),
]


def _result(
    envelope: dict[str, Any], status: wire.ProduceStatus, seq: int | None, partition: int | None
) -> wire.ProduceResultJson:
    result: wire.ProduceResultJson = {
        "id": envelope["id"],
        "subject": envelope["subject"],
        "status": status,
        "seq": seq,
    }
    if partition is not None:
        result["partition"] = partition
    return result


def _summed(total: wire.SubjectStatsJson, more: wire.SubjectStatsJson) -> wire.SubjectStatsJson:
    """An ordered subject's counters over its partitions (seqs count per partition)."""
    return {
        **total,
        "messages": total["messages"] + more["messages"],
        "bytes": total["bytes"] + more["bytes"],
        "next_seq": total["next_seq"] + more["next_seq"],
    }


def _group_summed(total: dict[str, int | str], more: dict[str, int | str]) -> dict[str, int | str]:
    counters = ("backlog", "in_flight", "retrying", "dead", "acked")
    return {**total, **{name: int(total[name]) + int(more[name]) for name in counters}}


def _log(subject: str, partition: int | None) -> str:
    """The log a message of ``subject`` is kept in: its own, or its partition's."""
    return subject if partition is None else partition_log(subject, partition)


OPERATIONS = tuple(name for _, _, name in _ROUTES)


def _operation(name: str) -> str:
    if name not in OPERATIONS:
        raise ValueError(f"unknown operation {name!r}; one of {', '.join(OPERATIONS)}")
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class _Unreadable:
    """A POST body that is not JSON (answered 400 once the switches had their say)."""

    reason: str


def _media_type(request: httpx.Request) -> str:
    media_type: str = request.headers.get("content-type", "")
    return media_type.partition(";")[0].strip().lower()


def _read(request: httpx.Request) -> Any:
    """A POST's or PUT's JSON document, a GET's query parameters."""
    if request.method == "GET":
        return dict(request.url.params)
    try:
        return orjson.loads(request.content)
    except orjson.JSONDecodeError as exc:
        return _Unreadable(str(exc))


def _json(status: int, doc: Any) -> httpx.Response:
    return httpx.Response(
        status, content=orjson.dumps(doc), headers={"content-type": "application/json"}
    )


def _rfc3339(micros_: int) -> str:
    moment = _EPOCH + timedelta(microseconds=micros_)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
