"""Error answers: codes, statuses and field names for unknown names and invalid requests."""

from __future__ import annotations

from typing import Any

import pytest

from qmq_outbox.envelope import OutgoingMessage
from tests.contract.conftest import Target


def error(response: Any) -> tuple[int, str, str | None]:
    body = response.json()["error"]
    return response.status_code, body["code"], body["field"]


def test_unknown_groups_consumers_and_subjects(target: Target) -> None:
    subject = target.subject()
    target.client.produce([OutgoingMessage(id="1", subject=subject, body=b"x")])
    base = {"subject": subject, "group": "g", "consumer": "c", "seqs": [0]}
    assert error(target.post("/v1/ack", base)) == (404, "group_not_found", "group")
    assert error(target.post("/v1/nack", base)) == (404, "group_not_found", "group")
    target.client.pull(subject, "fan", "a", mode="broadcast")
    fan = {**base, "group": "fan", "consumer": "b"}
    assert error(target.post("/v1/ack", fan)) == (404, "consumer_not_found", "consumer")
    assert error(target.http.get("/v1/subjects/nope.never")) == (
        404,
        "subject_not_found",
        "subject",
    )
    dead = f"/v1/subjects/{subject}/groups/nope/dead"
    assert error(target.http.get(dead)) == (404, "group_not_found", "group")
    assert error(target.http.get("/v1/subjects/nope.never/groups/g/dead")) == (
        404,
        "subject_not_found",
        "subject",
    )
    assert error(target.post(f"{dead}/redrive", {"all": True})) == (404, "group_not_found", "group")


def test_mode_conflict_is_409(target: Target) -> None:
    subject = target.subject()
    target.client.pull(subject, "g", "a")
    doc = {"subject": subject, "group": "g", "consumer": "a", "mode": "broadcast"}
    assert error(target.post("/v1/pull", doc)) == (409, "mode_conflict", "mode")


BAD_PULLS = [
    ({"group": "g", "consumer": "c"}, "missing_field", "subject"),
    ({"subject": "s", "group": "g", "consumer": "c", "max": 0}, "invalid_max", "max"),
    ({"subject": "s", "group": "g", "consumer": "c", "max": "5"}, "invalid_max", "max"),
    (
        {"subject": "s", "group": "g", "consumer": "c", "wait_ms": 60001},
        "invalid_wait_ms",
        "wait_ms",
    ),
    ({"subject": "s", "group": "g", "consumer": "c", "mode": "fanout"}, "invalid_mode", "mode"),
    ({"subject": "s", "group": "g", "consumer": "c", "start": "middle"}, "invalid_start", "start"),
    ({"subject": "s", "group": "g/x", "consumer": "c"}, "invalid_group", "group"),
    ({"subject": "s", "group": "g", "consumer": ""}, "invalid_consumer", "consumer"),
    ({"subject": "s", "group": "g", "consumer": "c", "colour": 1}, "unknown_field", "colour"),
    ({"subject": "s", "group": "g", "consumer": "c", "ack": []}, "invalid_ack", "ack"),
    ({"subject": "s", "group": "g", "consumer": "c", "ack": [-1]}, "invalid_ack", "ack[0]"),
    ({"subject": "s", "group": "g", "consumer": "c", "ack": "1"}, "invalid_ack", "ack"),
    ({"subject": "s", "group": "g", "consumer": "c", "min": 0}, "invalid_min", "min"),
    (
        {"subject": "s", "group": "g", "consumer": "c", "linger_ms": -1},
        "invalid_linger_ms",
        "linger_ms",
    ),
]


@pytest.mark.parametrize(("doc", "code", "field"), BAD_PULLS)
def test_bad_pulls(target: Target, doc: dict[str, Any], code: str, field: str) -> None:
    assert error(target.post("/v1/pull", doc)) == (400, code, field)


def test_bad_acks_nacks_redrives_and_params(target: Target) -> None:
    subject = target.subject()
    base = {"subject": subject, "group": "g", "consumer": "c"}
    assert error(target.post("/v1/ack", {**base, "seqs": []})) == (400, "invalid_seqs", "seqs")
    assert error(target.post("/v1/ack", {**base, "seqs": [-1]})) == (400, "invalid_seqs", "seqs[0]")
    nack = {**base, "seqs": [1], "delay_ms": -5}
    assert error(target.post("/v1/nack", nack)) == (400, "invalid_delay_ms", "delay_ms")
    target.client.pull(subject, "g", "c")
    redrive = f"/v1/subjects/{subject}/groups/g/dead/redrive"
    assert error(target.post(redrive, {})) == (400, "invalid_redrive", "seqs")
    assert error(target.post(redrive, {"seqs": [1], "all": True})) == (
        400,
        "invalid_redrive",
        "seqs",
    )
    dead = f"/v1/subjects/{subject}/groups/g/dead"
    assert error(target.http.get(f"{dead}?limit=0")) == (400, "invalid_limit", "limit")
    assert error(target.http.get(f"{dead}?after_seq=x")) == (400, "invalid_after_seq", "after_seq")
    assert error(target.http.get("/v1/subjects/bad%20name")) == (400, "invalid_subject", "subject")


def test_routes_and_health(target: Target) -> None:
    assert error(target.http.get("/v1/nothing")) == (404, "not_found", None)
    assert error(target.http.get("/v1/messages")) == (405, "method_not_allowed", None)
    assert target.http.get("/healthz").json() == {"status": "ok"}


def test_a_post_must_be_json(target: Target) -> None:
    doc = b'{"messages": [{"id": "1", "subject": "s", "body": "x"}]}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        answer = target.http.post(
            "/v1/messages", content=doc, headers={"content-type": content_type}
        )
        assert error(answer) == (415, "unsupported_media_type", "Content-Type")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("created_at", "9999-12-31T23:59:59-23:59"),
        ("created_at", "0001-01-01T00:00:00+23:59"),
        ("deliver_at", "0001-01-01T00:00:00+00:01"),
    ],
)
def test_timestamps_must_lie_in_the_served_range(target: Target, field: str, value: str) -> None:
    doc = {"messages": [{"id": "1", "subject": target.subject(), "body": "x", field: value}]}
    assert error(target.post("/v1/messages", doc)) == (
        400,
        f"invalid_{field}",
        f"messages[0].{field}",
    )


def test_only_the_lease_holder_acks(target: Target) -> None:
    subject = target.subject()
    target.client.produce([OutgoingMessage(id="1", subject=subject, body=b"x")])
    (message,) = target.client.pull(subject, "g", "holder")
    base = {"subject": subject, "group": "g", "seqs": [message.seq]}
    assert target.post("/v1/ack", {**base, "consumer": "other"}).json() == {
        "acked": 0,
        "unknown": [message.seq],
    }
    assert target.post("/v1/nack", {**base, "consumer": "other"}).json() == {
        "retrying": 0,
        "dead": 0,
    }
    assert target.post("/v1/ack", {**base, "consumer": "holder"}).json() == {
        "acked": 1,
        "unknown": [],
    }
