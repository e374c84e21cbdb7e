"""Delayed messages against a real broker process: timing, due order, stats, validation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import Message, OutgoingMessage
from tests.support.broker_process import BrokerProcess

LATE_MAX = 0.6  # seconds: a delayed message reaches a waiting consumer within this


def delayed(i: int | str, deliver_at: datetime | None, subject: str = "orders") -> OutgoingMessage:
    return OutgoingMessage(
        id=f"d-{i}", subject=subject, body=f"body-{i}".encode(), deliver_at=deliver_at
    )


class Receiver:
    """A consumer thread that long-polls and notes when each message arrived (wall clock)."""

    def __init__(self, url: str, subject: str = "orders") -> None:
        self._client = BrokerClient(url)
        self._subject = subject
        self.received: list[tuple[float, Message]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self._client.pull(self._subject, "g", "r", max_messages=1000, wait_ms=200)
            now = time.time()
            self.received.extend((now, m) for m in got)
            if got:
                self._client.ack(self._subject, "g", "r", [m.seq for m in got])

    def wait_for(self, count: int, timeout: float) -> list[tuple[float, Message]]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.received)


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
    with BrokerClient(broker.url) as c:
        yield c


@pytest.mark.parametrize("delay", [0.5, 3.0])
def test_a_delayed_message_arrives_on_time_and_not_before(
    broker: BrokerProcess, client: BrokerClient, delay: float
) -> None:
    with Receiver(broker.url) as receiver:
        time.sleep(0.3)  # the consumer is waiting in a long poll
        due = datetime.now(UTC) + timedelta(seconds=delay)
        [result] = client.produce([delayed(1, due)])
        assert (result.status, result.seq) == ("scheduled", None)
        [(arrived, message)] = receiver.wait_for(1, delay + 5)
    lateness = arrived - due.timestamp()
    assert 0 <= lateness <= LATE_MAX, f"arrived {lateness:+.3f} s from its due time"
    assert message.id == "d-1"
    assert message.stored_at is not None
    assert message.stored_at >= due


def test_messages_arrive_in_due_order_not_send_order(
    broker: BrokerProcess, client: BrokerClient
) -> None:
    base = datetime.now(UTC) + timedelta(seconds=1)
    offsets_ms = [700, 100, 400, 400, 0, 950, 250, 100, 800, 550]
    batch = [delayed(i, base + timedelta(milliseconds=ms)) for i, ms in enumerate(offsets_ms)]
    with Receiver(broker.url) as receiver:
        for message in batch[:5]:  # several requests, then one batch
            assert client.produce([message])[0].status == "scheduled"
        client.produce(batch[5:])
        got = receiver.wait_for(len(batch), 8)
    expected = [f"d-{i}" for i, _ in sorted(enumerate(offsets_ms), key=lambda p: (p[1], p[0]))]
    assert [m.id for _, m in got] == expected
    assert [m.seq for _, m in got] == list(range(len(batch)))
    for arrived, message in got:
        due = base + timedelta(milliseconds=offsets_ms[int(message.id[2:])])
        assert 0 <= arrived - due.timestamp() <= LATE_MAX


def test_past_and_present_deliver_at_are_stored_at_once(client: BrokerClient) -> None:
    past = datetime.now(UTC) - timedelta(days=3)
    results = client.produce([delayed(1, past), delayed(2, None)])
    assert [(r.status, r.seq) for r in results] == [("stored", 0), ("stored", 1)]
    assert [m.id for m in client.pull("orders", "g", "c", max_messages=10)] == ["d-1", "d-2"]


def test_scheduled_ids_are_deduplicated(client: BrokerClient) -> None:
    due = datetime.now(UTC) + timedelta(seconds=1)
    assert client.produce([delayed(1, due)])[0].status == "scheduled"
    resent = client.produce([delayed(1, due), delayed(1, None)])
    assert [(r.status, r.seq) for r in resent] == [("duplicate", None), ("duplicate", None)]
    got = client.pull("orders", "g", "c", wait_ms=5000)
    assert [(m.id, m.seq) for m in got] == [("d-1", 0)]
    after = client.produce([delayed(1, due + timedelta(hours=1))])
    assert [(r.status, r.seq) for r in after] == [("duplicate", 0)]
    assert client.subject("orders")["messages"] == 1


def test_schedule_stats_endpoint_subject_stats_and_metrics(
    broker: BrokerProcess, client: BrokerClient
) -> None:
    now = datetime.now(UTC)
    tomorrow = now + timedelta(days=1)
    client.produce([delayed(i, tomorrow + timedelta(seconds=i)) for i in range(3)])
    client.produce([delayed("x", tomorrow + timedelta(hours=2), subject="audit")])
    stats = client.subject("orders")
    assert stats["messages"] == 0
    assert stats["scheduled"]["messages"] == 3
    assert stats["scheduled"]["bytes"] > 0
    with httpx.Client(base_url=broker.url) as http:
        doc: dict[str, Any] = http.get("/v1/schedule").json()
        assert doc["messages"] == 4
        assert [h["messages"] for h in doc["hours"]] == [3, 1]
        assert doc["hours"][0]["hour"].startswith(tomorrow.strftime("%Y-%m-%dT%H:00:00"))
        assert doc["next_due_at"].startswith(tomorrow.strftime("%Y-%m-%dT%H:%M:%S"))
        assert doc["dispatch_lag_ms"] == 0
        assert http.get("/v1/schedule", params={"limit": 1}).json()["more_hours"] is True
        assert "/v1/schedule" in http.get("/openapi.json").json()["paths"]
        metrics = http.get("/metrics").text
    assert "qmq_broker_schedule_pending_messages 4.0" in metrics
    assert "qmq_broker_schedule_scheduled_messages_total 4.0" in metrics


def _produce_raw(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/messages",
        content=orjson.dumps({"messages": messages}),
        headers={"content-type": "application/json"},
    )


@pytest.mark.parametrize(
    ("deliver_at", "code"),
    [
        ("tomorrow", "invalid_deliver_at"),
        ("2030-13-01T00:00:00Z", "invalid_deliver_at"),
        ("2030-01-01", "invalid_deliver_at"),
        (1893456000, "invalid_deliver_at"),
        ("2030-01-01T00:00:00", "invalid_deliver_at"),  # naive: no offset
        ("far", "delay_too_long"),
    ],
)
def test_bad_deliver_at_is_rejected_naming_the_field(
    broker: BrokerProcess, client: BrokerClient, deliver_at: object, code: str
) -> None:
    if deliver_at == "far":
        deliver_at = (datetime.now(UTC) + timedelta(days=731)).isoformat()
    good = {"id": "ok", "subject": "orders", "body": "fine"}
    bad = {"id": "bad", "subject": "orders", "body": "x", "deliver_at": deliver_at}
    response = _produce_raw(broker.url, [good, bad])
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["field"]) == (code, "messages[1].deliver_at")
    assert client.subjects() == []  # all or nothing: the good one is not stored either


def test_max_delay_is_configurable(broker_factory: type[BrokerProcess], tmp_path: Path) -> None:
    proc = broker_factory(tmp_path / "short", extra_args=["--max-delay", "1h"]).start()
    now = datetime.now(UTC)
    with BrokerClient(proc.url) as c:
        assert c.produce([delayed(1, now + timedelta(minutes=59))])[0].status == "scheduled"
    response = _produce_raw(
        proc.url,
        [
            {
                "id": "2",
                "subject": "s",
                "body": "",
                "deliver_at": (now + timedelta(hours=2)).isoformat(),
            }
        ],
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "delay_too_long"
    assert response.json()["error"]["field"] == "messages[0].deliver_at"
