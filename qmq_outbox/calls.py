"""The broker's API v1 as calls: each function describes one request (method, path, JSON
body) and how its answer is read, as a ``Call``; ``qmq_outbox.client`` sends them, blocking
or awaited. A 200 answer is read; 429 and 5xx become ``BrokerUnavailable`` (retry later),
other 4xx ``BrokerRejected`` (permanent).

Ordered subjects (docs/architecture.md 3.6): ``declare_subject`` and the route changes
(``split_partition``, ``merge_partitions``, ``move_partition``) answer the subject's routes
document, as ``routes`` does; a pull in ``mode="ordered"`` gets messages that carry their
``partition``, and their acks and nacks name it (``partition=``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import httpx
import orjson

import qmq_wire
from qmq_outbox.envelope import Message, OutgoingMessage, ProduceResult
from qmq_outbox.errors import BrokerError, BrokerRejected, BrokerUnavailable
from qmq_wire import OnDead, PositionJson, ResetAnswerJson, RoutesAnswerJson
from qmq_wire.records import RECORDS_MEDIA_TYPE, RecordError, is_records_answer, read_records_answer

DEFAULT_TIMEOUT = 10.0  # seconds a call may take (a long poll: plus its wait)

PullMode = Literal["shared", "broadcast", "ordered"]
StartAt = Literal["earliest", "latest"]
Position = PositionJson
"""Where a group reads from: ``"earliest"``, ``"latest"``, ``{"seq": n}`` or
``{"time": "2026-11-28T09:00:00Z"}`` (RFC 3339 with an offset)."""

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Call(Generic[T]):
    """One request of the API and how to read its answer."""

    method: Literal["GET", "POST", "PUT"]
    path: str
    read: Callable[[Any], T]
    content: bytes | None = None
    params: dict[str, Any] | None = None
    timeout: float | None = None  # None: the client's
    headers: tuple[tuple[str, str], ...] = ()  # the request's own, beside the client's
    decode: Callable[[bytes], Any] = orjson.loads  # a 200 answer's body, for ``read``

    def request(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        timeout = httpx.USE_CLIENT_DEFAULT if self.timeout is None else self.timeout
        return http.build_request(
            self.method,
            self.path,
            content=self.content,
            params=self.params,
            headers=dict(self.headers),
            timeout=timeout,
        )

    def answer(self, response: httpx.Response) -> T:
        return self.answer_body(response.status_code, response.content)

    def answer_body(self, status: int, content: bytes) -> T:
        """The answer from the status and body alone (``answer`` reads them off a Response)."""
        if status == 200:
            return self.read(self.decode(content))
        return self.read(_check(status, content))


def _check(status: int, content: bytes) -> Any:
    if status == 200:
        return orjson.loads(content)
    try:
        error = orjson.loads(content)["error"]
        code, message, field = error["code"], error["message"], error.get("field")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        code, message, field = "http_error", content.decode("utf-8", "replace")[:200], None
    if qmq_wire.transient(status):
        raise BrokerUnavailable(f"broker answered {status} {code}: {message}")
    raise BrokerRejected(status=status, code=code, message=message, field=field)


def _as_dict(doc: Any) -> dict[str, Any]:
    result: dict[str, Any] = doc
    return result


def _produce_results(doc: Any) -> list[ProduceResult]:
    adopt = ProduceResult.adopt  # the decoded dicts are ours
    return [adopt(r) for r in doc["results"]]


def _post(path: str, doc: Any, read: Callable[[Any], T], **options: Any) -> Call[T]:
    return Call(method="POST", path=path, read=read, content=orjson.dumps(doc), **options)


def _seqs(
    subject: str, group: str, consumer: str, seqs: Sequence[int], partition: int | None
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "subject": subject,
        "group": group,
        "consumer": consumer,
        "seqs": list(seqs),
    }
    if partition is not None:  # only an ordered subject's acks and nacks name one
        doc["partition"] = partition
    return doc


def produce(messages: Sequence[OutgoingMessage]) -> Call[list[ProduceResult]]:
    """Store a batch (1..1000); returns one result per message in request order."""
    doc = {"messages": [m.to_wire() for m in messages]}
    return _post("/v1/messages", doc, _produce_results)


def produce_raw(body: bytes) -> Call[list[ProduceResult]]:
    """Send an already-encoded ``{"messages": [...]}`` document (load generators)."""
    return Call(method="POST", path="/v1/messages", read=_produce_results, content=body)


def pull(
    subject: str,
    group: str,
    consumer: str,
    *,
    max_messages: int = 32,
    wait_ms: int = 0,
    mode: PullMode = "shared",
    start: Position = "earliest",
    min_messages: int = 1,
    linger_ms: int = 0,
    max_keys: int | None = None,
    tags: Sequence[str] | None = None,
) -> Call[list[Message]]:
    """Lease up to ``max_messages`` of ``subject`` for ``group``, long-polling ``wait_ms``.

    ``start``: where a group new to the subject (a broadcast consumer new to the group)
    reads from; a seq or a time replays from there (not a seq on an ordered subject).
    ``mode="ordered"`` (the only mode of an ordered subject): messages of the partitions
    this consumer holds, each partition's in seq order; a key's next messages come once
    those out are acked, other keys' meanwhile, up to ``max_keys`` keys per partition
    (None: the broker's default, 16; 1: a partition's next batch comes once this one is
    acked). ``min_messages``/``linger_ms``: during the first ``linger_ms`` (within
    ``wait_ms``) the broker answers only with at least ``min_messages``: fewer, fuller
    pulls for some latency. ``tags``: the group's tag filter (any of them), fixed by the
    group's first pull (another one is ``BrokerRejected`` 409 ``tags_conflict`` until the
    group is reset); the broker skips the rest for the group without a lease. Not for
    ordered subjects.
    """
    doc = _pull_doc(
        subject, group, consumer, max_messages, wait_ms, mode, start, min_messages, linger_ms,
        tags,
    )  # fmt: skip
    if max_keys is not None:
        doc["max_keys"] = max_keys
    timeout = DEFAULT_TIMEOUT + wait_ms / 1000
    return _post("/v1/pull", doc, _messages, timeout=timeout, **_RECORDS)


def _pull_doc(
    subject: str,
    group: str,
    consumer: str,
    max_messages: int,
    wait_ms: int,
    mode: PullMode,
    start: Position,
    min_messages: int,
    linger_ms: int,
    tags: Sequence[str] | None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "subject": subject,
        "group": group,
        "consumer": consumer,
        "max": max_messages,
        "wait_ms": wait_ms,
        "mode": mode,
        "start": start,
    }
    if min_messages != 1 or linger_ms:
        doc["min"], doc["linger_ms"] = min_messages, linger_ms
    if tags:
        doc["tags"] = list(tags)
    return doc


def _pull_answer(content: bytes) -> dict[str, Any]:
    """A pull's answer with its messages read: the records as stored (what the SDK asks
    for, ``_RECORDS``), or JSON (a broker or a fake that answers only JSON)."""
    if not is_records_answer(content):
        doc: dict[str, Any] = orjson.loads(content)
        adopt = Message.adopt  # the decoded dicts are ours
        doc["messages"] = [adopt(m) for m in doc["messages"]]
        return doc
    try:
        fields, entries = read_records_answer(content, orjson.loads)
    except RecordError as exc:
        raise BrokerError(f"broker answered a pull that does not read: {exc}") from exc
    from_record = Message.from_record
    return {**fields, "messages": [from_record(*entry) for entry in entries]}


# A pull asks for the records as stored: no JSON per message on either side.
_RECORDS: dict[str, Any] = {"headers": (("accept", RECORDS_MEDIA_TYPE),), "decode": _pull_answer}


def _messages(doc: Any) -> list[Message]:
    messages: list[Message] = doc["messages"]
    return messages


@dataclasses.dataclass(frozen=True, slots=True)
class AckedPull:
    """What ``ack_and_pull`` answers: the new batch, and how the acks it carried went."""

    messages: list[Message]
    acked: int
    unknown: list[int]  # seqs that were not leased to this consumer (see ``ack``)


def ack_and_pull(
    subject: str,
    group: str,
    consumer: str,
    ack: Sequence[int],
    *,
    max_messages: int = 32,
    wait_ms: int = 0,
    mode: PullMode = "shared",
    start: Position = "earliest",
    min_messages: int = 1,
    linger_ms: int = 0,
    tags: Sequence[str] | None = None,
) -> Call[AckedPull]:
    """Ack ``ack`` (1..1000 seqs, e.g. the previous batch) and ``pull`` in one request.

    The acks are as durable when this answers as ``ack`` makes them. If it fails after the
    broker applied them, sending them again answers them as ``unknown``. Not for ordered
    subjects: their acks name a partition, so they go by ``ack``. ``tags`` as for ``pull``.
    """
    doc = _pull_doc(
        subject, group, consumer, max_messages, wait_ms, mode, start, min_messages, linger_ms,
        tags,
    )  # fmt: skip
    doc["ack"] = list(ack)
    timeout = DEFAULT_TIMEOUT + wait_ms / 1000
    return _post("/v1/pull", doc, _acked_pull, timeout=timeout, **_RECORDS)


def _acked_pull(doc: Any) -> AckedPull:
    return AckedPull(_messages(doc), int(doc.get("acked", 0)), list(doc.get("unknown") or []))


def ack(
    subject: str,
    group: str,
    consumer: str,
    seqs: Sequence[int],
    *,
    partition: int | None = None,
) -> Call[dict[str, Any]]:
    """Ack leased messages: ``{"acked": n, "unknown": [seqs not leased to us]}``.

    ``partition``: required for an ordered subject (its seqs count per partition), never
    given for a plain one."""
    return _post("/v1/ack", _seqs(subject, group, consumer, seqs, partition), _as_dict)


def nack(
    subject: str,
    group: str,
    consumer: str,
    seqs: Sequence[int],
    *,
    delay_ms: int | None = None,
    error: str | None = None,
    partition: int | None = None,
) -> Call[dict[str, Any]]:
    """Give leased messages back for a retry after ``delay_ms`` (None: the broker's backoff).

    ``partition`` as for ``ack``."""
    doc = _seqs(subject, group, consumer, seqs, partition)
    doc |= {"delay_ms": delay_ms, "error": error}
    return _post("/v1/nack", doc, _as_dict)


def subjects() -> Call[list[dict[str, Any]]]:
    """Every subject with its counters."""
    return Call(method="GET", path="/v1/subjects", read=lambda doc: list(doc["subjects"]))


def subject(subject: str) -> Call[dict[str, Any]]:
    """One subject with its groups."""
    return Call(method="GET", path=f"/v1/subjects/{subject}", read=_as_dict)


def dead_letters(
    subject: str,
    group: str,
    *,
    limit: int = 100,
    after_seq: int | None = None,
    partition: int | None = None,
) -> Call[dict[str, Any]]:
    """A page of the group's dead letters, oldest first (of one ``partition`` of an ordered
    subject)."""
    params: dict[str, Any] = {"limit": limit}
    if after_seq is not None:
        params["after_seq"] = after_seq
    if partition is not None:
        params["partition"] = partition
    path = f"/v1/subjects/{subject}/groups/{group}/dead"
    return Call(method="GET", path=path, read=_as_dict, params=params)


def redrive(
    subject: str, group: str, seqs: Sequence[int] | None = None, *, partition: int | None = None
) -> Call[int]:
    """Put dead letters back (all of them when ``seqs`` is None); returns how many.
    ``partition``: which one of an ordered subject."""
    doc: dict[str, Any] = {"all": True} if seqs is None else {"seqs": list(seqs)}
    if partition is not None:
        doc["partition"] = partition
    path = f"/v1/subjects/{subject}/groups/{group}/dead/redrive"
    return _post(path, doc, lambda answer: int(answer["redriven"]))


def reset_group(
    subject: str,
    group: str,
    to: Position,
    *,
    force: bool = False,
    partition: int | None = None,
) -> Call[ResetAnswerJson]:
    """Move ``group`` to ``to``: replay from a seq or a time, or skip to ``"latest"``.

    Refused (409 ``group_busy``) while the group has messages leased out, unless ``force``:
    then those leases are dropped and their acks answer ``unknown``. Leases, retries and
    dead letters at or after the new position go (those messages are delivered afresh);
    on an ordered subject every partition moves (a time maps to each partition's first
    message stored at or after it), or ``partition`` alone (required with a seq)."""
    doc: dict[str, Any] = {"to": to, "force": force}
    if partition is not None:
        doc["partition"] = partition
    path = f"/v1/subjects/{subject}/groups/{group}/reset"
    return _post(path, doc, _reset_answer)


def _reset_answer(doc: Any) -> ResetAnswerJson:
    answer: ResetAnswerJson = doc
    return answer


# -- ordered subjects: declaring and changing routes (operator calls) ---------------------------


def _routes_document(doc: Any) -> RoutesAnswerJson:
    routes: RoutesAnswerJson = doc
    return routes


def declare_subject(
    subject: str, *, partitions: int = 1, on_dead: OnDead = "skip"
) -> Call[RoutesAnswerJson]:
    """Make ``subject`` ordered with ``partitions`` (1..64) physical partitions; returns its
    routes. The same declaration again answers the same; a different one, or a subject
    that already stored messages unordered, is rejected (409 ``subject_conflict``).
    ``on_dead="block"``: a partition waits at a dead letter until it is redriven."""
    doc = {"ordered": True, "partitions": partitions, "on_dead": on_dead}
    content = orjson.dumps(doc)
    path = f"/v1/subjects/{subject}"
    return Call(method="PUT", path=path, read=_routes_document, content=content)


def routes(subject: str) -> Call[RoutesAnswerJson]:
    """An ordered subject's routes: current ranges, history, and each group's version."""
    path = f"/v1/subjects/{subject}/routes"
    return Call(method="GET", path=path, read=_routes_document)


def split_partition(subject: str, *, partition: int, at: int) -> Call[RoutesAnswerJson]:
    """Split ``partition``'s logic range ``[lo, hi)`` at ``at`` onto two new partitions."""
    path = f"/v1/subjects/{subject}/partitions/split"
    return _post(path, {"partition": partition, "at": at}, _routes_document)


def merge_partitions(subject: str, *, partitions: Sequence[int]) -> Call[RoutesAnswerJson]:
    """Merge two partitions with adjacent ranges into one new partition."""
    path = f"/v1/subjects/{subject}/partitions/merge"
    return _post(path, {"partitions": list(partitions)}, _routes_document)


def move_partition(subject: str, *, partition: int) -> Call[RoutesAnswerJson]:
    """Move ``partition``'s range, unchanged, onto one new partition."""
    path = f"/v1/subjects/{subject}/partitions/move"
    return _post(path, {"partition": partition}, _routes_document)
