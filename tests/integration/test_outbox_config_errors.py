"""Configuration errors never kill rows (issue 36 item 3), against a stub HTTP server that
answers what a misconfigured deployment meets, then a real broker: PostgreSQL throughout.

Only a rejection that names a message (400 with ``messages[i]...``) makes a row ``dead``,
and only that row; a refused token, right, route, method or content type, a 5xx and a
refused connection leave every row ``pending`` with its attempt counted and its next try
moved, and one log line for the outage. Pointed at a real broker afterwards, every pending
row is stored exactly once.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from qmq_outbox.client import BrokerClient
from qmq_outbox.compensator import Compensator
from qmq_outbox.errors import ConfigurationError
from qmq_outbox.outbox import Outbox
from qmq_outbox.schema import outbox_table
from qmq_outbox.transports import QmqTransport
from tests.support.broker_process import BrokerProcess, free_port
from tests.support.outbox import stored_ids, unique_subject, wait_for

pytestmark = pytest.mark.timeout(120)
BACKOFF = timedelta(milliseconds=50)


class Stub(ThreadingHTTPServer):
    """Answers every request with ``status`` and a broker-shaped error, except that with
    ``status`` 200 it stores the batch unless it holds ``poison`` (then 400 naming it)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.status = 200
        self.poison: str | None = None
        self.requests: list[str] = []
        self.stored: Counter[str] = Counter()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


ERRORS = {
    401: ("unauthorized", "no or an unknown token", None),
    403: ("forbidden", "token may not produce to this subject", "messages[0].subject"),
    404: ("not_found", "no route {path}", None),
    405: ("method_not_allowed", "POST is not allowed here", None),
    415: ("unsupported_media_type", "send Content-Type: application/json", "Content-Type"),
    500: ("internal_error", "boom", None),
    503: ("recovering", "the broker is still recovering", None),
}


class StubHandler(BaseHTTPRequestHandler):
    server: Stub

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests read what the stub recorded instead."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        stub = self.server
        with stub.lock:
            stub.requests.append(self.path)
            status = stub.status
            if status != 200:
                code, message, field = ERRORS[status]
                error = {"code": code, "message": message.format(path=self.path), "field": field}
                return self._answer(status, {"error": error})
            messages = json.loads(body)["messages"]
            ids = [m["id"] for m in messages]
            if stub.poison in ids:
                index = ids.index(stub.poison)
                field = f"messages[{index}].body"
                error = {"code": "invalid_body", "message": "not this one", "field": field}
                return self._answer(400, {"error": error})
            stub.stored.update(ids)
            results = [
                {"id": m["id"], "subject": m["subject"], "status": "stored", "seq": n}
                for n, m in enumerate(messages)
            ]
        self._answer(200, {"results": results})

    def _answer(self, status: int, doc: dict[str, Any]) -> None:
        payload = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    thread = threading.Thread(target=server.serve_forever, name="stub-broker", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def db_url(pg_url_migrated: str) -> str:
    return pg_url_migrated  # PostgreSQL alone here


@pytest.fixture(scope="module")
def broker(module_broker: BrokerProcess) -> BrokerProcess:
    return module_broker


def rows(engine: sa.Engine) -> dict[str, sa.Row[Any]]:
    with engine.connect() as conn:
        return {r.message_id: r for r in conn.execute(sa.select(outbox_table))}


def publish(engine: sa.Engine, outbox: Outbox, subject: str, count: int) -> list[str]:
    maker = sessionmaker(engine)
    outbox.install(maker)
    with maker.begin() as session:
        return [outbox.publish(session, subject, {"i": i}) for i in range(count)]


def actions(caplog: pytest.LogCaptureFixture, suffix: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if str(getattr(r, "action", "")).endswith(suffix) and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("path", ["/v1", "/v1/messages", "/x/"])
def test_a_broker_url_with_a_path_is_refused_at_construction(path: str) -> None:
    url = f"http://127.0.0.1:8931{path}"
    for make in (
        lambda: Outbox(broker_url=url),
        lambda: QmqTransport(url=url),
        lambda: Compensator(engine=sa.create_engine("sqlite://"), broker_url=url),
    ):
        with pytest.raises(ConfigurationError) as refused:
            make()
        text = str(refused.value)
        assert "\n" not in text
        assert f"'{url}' is not a broker URL: use http(s)://host[:port], without a path" in text
    for bad in ("http://u:secret@127.0.0.1:8931", "http://127.0.0.1:8931?token=x"):
        with pytest.raises(ConfigurationError, match="not a broker URL") as refused:
            Outbox(broker_url=bad)
        assert "secret" not in str(refused.value)
    assert Outbox(broker_url="http://127.0.0.1:8931/", dispatch=False).transport is not None


@pytest.mark.parametrize("status", [401, 403, 404, 405, 415, 500, 503, "refused"])
def test_a_refusal_of_the_request_leaves_every_row_pending_until_the_broker_is_right(
    status: int | str,
    stub: Stub,
    engine: sa.Engine,
    broker: BrokerProcess,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="qmq_outbox")
    subject = unique_subject("cfg")
    url = f"http://127.0.0.1:{free_port()}" if status == "refused" else stub.url
    if isinstance(status, int):
        stub.status = status
    outbox = Outbox(broker_url=url)
    ids = publish(engine, outbox, subject, 6)
    if isinstance(status, int):
        wait_for(lambda: stub.requests, what="the dispatcher's attempt")
    assert outbox.close(drain_timeout=10)
    assert {(r.status, r.attempts) for r in rows(engine).values()} == {("pending", 0)}
    assert len(actions(caplog, "outbox.dispatcher.broker.failing")) == 1

    # The compensator: even allowed a single attempt, a refused configuration kills nothing.
    limit = 1 if isinstance(status, int) and status < 500 else None
    comp = Compensator(
        engine=engine,
        broker_url=url,
        grace=timedelta(0),
        max_attempts=limit,
        backoff_base=BACKOFF,
        backoff_cap=BACKOFF,
    )
    before = datetime.now(UTC)
    first = comp.run_once()
    assert (first.claimed, first.sent, first.dead, first.retried) == (6, 0, 0, 6)
    after_first = rows(engine)
    for row in after_first.values():
        assert (row.status, row.attempts) == ("pending", 1)
        assert row.next_attempt_at.replace(tzinfo=UTC) > before
        assert str(status) in row.last_error
    wait_for(
        lambda: (
            datetime.now(UTC)
            > max(r.next_attempt_at.replace(tzinfo=UTC) for r in after_first.values())
        )
    )
    second = comp.run_once()
    comp.stop(5)
    assert (second.claimed, second.dead, second.retried) == (6, 0, 6)
    assert {(r.status, r.attempts) for r in rows(engine).values()} == {("pending", 2)}
    assert len(actions(caplog, "outbox.compensator.broker.failing")) == 1
    assert not actions(caplog, "outbox.dead")

    # Pointed at the broker it was meant for: every row is stored, once.
    fixed = Compensator(engine=engine, broker_url=broker.url, grace=timedelta(0))
    wait_for(
        lambda: (
            fixed.run_once().sent == 0 and set(r.status for r in rows(engine).values()) == {"sent"}
        ),
        what="all rows sent",
    )
    fixed.stop(5)
    with BrokerClient(broker.url) as client:
        assert stored_ids(client, subject) == Counter(ids)
    assert stub.stored == Counter()


def test_only_the_message_a_400_names_goes_dead_and_the_rest_of_its_batch_is_sent(
    stub: Stub, engine: sa.Engine
) -> None:
    subject = unique_subject("poison")
    outbox = Outbox(broker_url=stub.url, batch_size=500)
    maker = sessionmaker(engine)
    outbox.install(maker)
    with maker.begin() as session:
        ids = [outbox.publish(session, subject, {"i": i}) for i in range(7)]
        stub.poison = ids[4]
    assert outbox.close(drain_timeout=10)
    found = rows(engine)
    assert found[ids[4]].status == "dead"
    assert "400 invalid_body (messages[" in found[ids[4]].last_error
    assert {found[i].status for i in ids if i != ids[4]} == {"sent"}
    assert stub.stored == Counter(i for i in ids if i != ids[4])

    # The compensator judges a 400 naming a message the same way, on its own row only.
    with engine.begin() as conn:
        conn.execute(sa.update(outbox_table).values(status="pending", attempts=0, sent_at=None))
    stub.stored.clear()
    comp = Compensator(engine=engine, broker_url=stub.url, grace=timedelta(0))
    result = comp.run_once()
    comp.stop(5)
    assert (result.claimed, result.sent, result.dead) == (7, 6, 1)
    assert {i for i, r in rows(engine).items() if r.status == "dead"} == {ids[4]}
    assert stub.stored == Counter(i for i in ids if i != ids[4])
