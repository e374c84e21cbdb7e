"""The broker under hostile and malformed input, against real broker processes.

Each test starts from a request that once did harm (issue 13 lists them): a poison
timestamp, a loose tokens file, a body parsed before auth, a cross-site POST, a group lost
to kill -9, rights too wide, a Unicode digit in a query, a subject gone after restart.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

import qmq_wire
from qmq_broker.engine import Broker
from qmq_broker.messages import IncomingMessage
from tests.support.broker_process import BrokerProcess
from tests.support.engine import run_broker

JSON = {"content-type": "application/json"}


def post(http: httpx.Client, path: str, doc: Any, **headers: str) -> httpx.Response:
    return http.post(path, content=orjson.dumps(doc), headers={**JSON, **headers})


def error(response: httpx.Response) -> tuple[int, str, str | None]:
    body = response.json()["error"]
    return response.status_code, body["code"], body["field"]


def pull(
    http: httpx.Client, subject: str, group: str, consumer: str = "c1", **more: Any
) -> httpx.Response:
    return post(
        http, "/v1/pull", {"subject": subject, "group": group, "consumer": consumer, **more}
    )


# --- 1. poison messages -----------------------------------------------------------------


def test_the_reported_poison_batch_is_stored_and_served_exactly(broker: BrokerProcess) -> None:
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        doc = {
            "messages": [
                {
                    "id": "p1",
                    "subject": "pz",
                    "body": "x",
                    "created_at": "9999-12-31T23:59:59.999999Z",
                },
                {"id": "p2", "subject": "pz", "body": "good"},
            ]
        }
        assert post(http, "/v1/messages", doc).status_code == 200
        answer = pull(http, "pz", "g", max=10)
        assert answer.status_code == 200
        served = answer.json()["messages"]
        assert (served[0]["id"], served[0]["created_at"]) == ("p1", "9999-12-31T23:59:59.999999Z")
        assert [m["id"] for m in served] == ["p1", "p2"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("created_at", "9999-12-31T23:59:59-23:59"),
        ("created_at", "0001-01-01T00:00:00+23:59"),
        ("deliver_at", "0001-01-01T00:00:00+23:59"),
    ],
)
def test_timestamps_outside_the_served_range_are_400_and_the_connection_lives(
    broker: BrokerProcess, field: str, value: str
) -> None:
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        bad = {
            "messages": [
                {"id": "ok", "subject": "pz", "body": "x"},
                {"id": "t", "subject": "pz", "body": "x", field: value},
            ]
        }
        answer = post(http, "/v1/messages", bad)
        assert error(answer) == (400, f"invalid_{field}", f"messages[1].{field}")
        assert qmq_wire.MIN_TIME in answer.json()["error"]["message"]
        # Nothing of the batch was stored, and the same keep-alive connection still works.
        assert http.get("/v1/subjects").json()["subjects"] == []
        good = {"messages": [{"id": "ok", "subject": "pz", "body": "x"}]}
        assert post(http, "/v1/messages", good).json()["results"][0]["status"] == "stored"
        assert answer.headers.get("connection") != "close"


def _store_unservable(data_dir: Path) -> None:
    """What an older broker accepted: a created_at past year 9999, then a good message."""

    async def script(broker: Broker) -> None:
        common: dict[str, Any] = {
            "subject": "pz",
            "key": None,
            "headers": {},
            "body_base64": False,
            "producer": None,
            "deliver_at_us": 0,
        }
        await broker.services.producer.produce(
            [
                IncomingMessage(
                    id="p1", body=b"x", created_at_us=qmq_wire.MAX_TIME_US + 1, **common
                ),
                IncomingMessage(id="p2", body=b"good", created_at_us=None, **common),
            ]
        )

    run_broker(data_dir, script)


def test_a_stored_message_no_answer_can_carry_is_dead_lettered_and_the_rest_served(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    data = tmp_path / "old"
    _store_unservable(data)
    proc = broker_factory(data, extra_args=["--ack-timeout", "1s", "--max-attempts", "2"]).start()
    with httpx.Client(base_url=proc.url, timeout=10) as http:
        answer = pull(http, "pz", "g", max=10)
        assert answer.status_code == 200
        assert [m["id"] for m in answer.json()["messages"]] == ["p2"]
        dead = http.get("/v1/subjects/pz/groups/g/dead")
        assert dead.status_code == 200
        (letter,) = dead.json()["dead"]
        assert (letter["seq"], letter["message"]) == (0, None)
        assert letter["error"] == "unreadable record"  # the broker log says why
    assert proc.terminate() == 0
    proc.restart()
    with httpx.Client(base_url=proc.url, timeout=10) as http:
        assert http.get("/v1/subjects/pz/groups/g/dead").status_code == 200
        assert pull(http, "pz", "g2", max=10).json()["messages"][0]["id"] == "p2"


# --- 2. the tokens file -----------------------------------------------------------------


def _start_with_tokens(tmp_path: Path, tokens: Any) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "tokens.json"
    path.write_bytes(orjson.dumps({"tokens": tokens}))
    cmd = [sys.executable, "-m", "qmq_outbox", "broker", "--data-dir", str(tmp_path / "d")]
    cmd += ["--port", "1", "--auth-file", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"name": "a", "token": "t", "admin": "false"}, "admin"),
        ({"name": "a", "token": "t", "produce": "inv"}, "produce"),
        ({"name": "a", "token": ""}, "token"),
        ({"name": "a", "token": "tök"}, "token"),
        ({"name": "a", "token": "t", "consume": [{"subject": "x", "groups": []}]}, "groups"),
        ({"name": "a", "token": "t", "rights": ["*"]}, "rights: unknown key"),
    ],
)
def test_a_bad_tokens_file_stops_the_broker_with_exit_2_and_one_line(
    tmp_path: Path, entry: dict[str, Any], named: str
) -> None:
    done = _start_with_tokens(tmp_path, [{"name": "ok", "token": "fine"}, entry])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "tokens[1] ('a')" in lines[0]
    assert named in lines[0]


def test_the_same_token_twice_is_refused(tmp_path: Path) -> None:
    done = _start_with_tokens(tmp_path, [{"name": "a", "token": "t"}, {"name": "b", "token": "t"}])
    assert done.returncode == 2
    assert "tokens[1] ('b'): the same token as tokens[0]" in done.stderr


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.json"
    tokens = [
        {"name": "producer", "token": "t-produce", "produce": ["order.*"]},
        {
            "name": "billing",
            "token": "t-billing",
            "consume": [{"subject": "order.*", "groups": ["billing"]}],
        },
        {"name": "ops", "token": "t-ops", "manage": ["*"]},
        {
            "name": "auditor",
            "token": "t-audit",
            "manage": [{"subject": "order.*", "groups": ["billing"]}],
        },
        {"name": "root", "token": "t-root", "admin": True},
    ]
    path.write_bytes(orjson.dumps({"tokens": tokens}))
    return path


@pytest.fixture
def authed(broker_factory: type[BrokerProcess], tmp_path: Path, tokens_file: Path) -> BrokerProcess:
    return broker_factory(
        tmp_path / "authed",
        extra_args=["--auth-file", str(tokens_file), "--ack-timeout", "1s", "--max-attempts", "1"],
    ).start()


@pytest.mark.parametrize(
    "authorization",
    ["Bearer tök".encode(), b"Bearer ", b"Bearer", b"Basic dDp0", b"Bearer \xff\xfe"],
)
def test_odd_tokens_are_401_never_500(authed: BrokerProcess, authorization: bytes) -> None:
    # Raw bytes on a socket: httpx would refuse to send some of these headers.
    with socket.create_connection(("127.0.0.1", authed.port), timeout=5) as sock:
        sock.sendall(
            b"GET /v1/subjects HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
            + authorization
            + b"\r\nConnection: close\r\n\r\n"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), head
    assert orjson.loads(body)["error"]["code"] == "unauthorized"


# --- 3. authentication before the body --------------------------------------------------


def test_an_unauthenticated_request_costs_only_its_headers(authed: BrokerProcess) -> None:
    with httpx.Client(base_url=authed.url, timeout=10) as http:
        assert error(post(http, "/v1/messages", {}))[:2] == (401, "unauthorized")
        assert error(post(http, "/v1/pull", {}))[:2] == (401, "unauthorized")
    # A 60 MB body announced but never sent: the 401 comes without waiting for it.
    with socket.create_connection(("127.0.0.1", authed.port), timeout=5) as sock:
        head = (
            "POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 60000000\r\n\r\n"
        )
        began = time.monotonic()
        sock.sendall(head.encode())
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert time.monotonic() - began < 3


# --- 4. cross-site requests and DNS rebinding -------------------------------------------


def test_cross_site_writes_are_refused(broker: BrokerProcess) -> None:
    doc = orjson.dumps({"messages": [{"id": "x", "subject": "orders", "body": "x"}]})
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        plain = http.post("/v1/messages", content=doc, headers={"content-type": "text/plain"})
        assert error(plain) == (415, "unsupported_media_type", "Content-Type")
        bare = http.post("/v1/messages", content=doc)
        assert error(bare)[:2] == (415, "unsupported_media_type")
        foreign = http.post(
            "/v1/messages", content=doc, headers={**JSON, "origin": "https://evil.example"}
        )
        assert error(foreign) == (403, "origin_not_allowed", "Origin")
        rebound = http.post(
            "/v1/messages", content=doc, headers={**JSON, "host": "evil.example:8931"}
        )
        assert error(rebound) == (403, "host_not_allowed", "Host")
        redrive = http.post(
            "/v1/subjects/orders/groups/g/dead/redrive",
            content=b'{"all": true}',
            headers={"content-type": "text/plain"},
        )
        assert error(redrive)[:2] == (415, "unsupported_media_type")
        assert http.get("/v1/subjects").json()["subjects"] == []  # nothing got through
        charset = {
            "content-type": "application/json; charset=utf-8",
            "host": f"localhost:{broker.port}",
        }
        assert http.post("/v1/messages", content=doc, headers=charset).status_code == 200


def test_allowed_origins_and_hosts_are_served(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    proc = broker_factory(
        tmp_path / "d",
        extra_args=["--allow-origin", "https://console.example", "--allow-host", "qmq.internal"],
    ).start()
    with httpx.Client(base_url=proc.url, timeout=10) as http:
        console = {"origin": "https://console.example", "host": "qmq.internal"}
        assert http.get("/v1/subjects", headers=console).status_code == 200
        assert error(http.get("/v1/subjects", headers={"origin": "null"}))[0] == 403
        assert error(http.get("/v1/subjects", headers={"host": "other.internal"}))[0] == 403


# --- 5 and 10. groups and subjects that exist only through pulls ------------------------


def test_a_latest_group_is_durable_before_its_first_pull_is_answered(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    proc = broker_factory(tmp_path / "d").start()
    with httpx.Client(base_url=proc.url, timeout=10) as http:
        post(http, "/v1/messages", {"messages": [{"id": "old", "subject": "s", "body": "x"}]})
        assert pull(http, "s", "late", start="latest").json()["messages"] == []
    proc.kill9()  # well within the checkpoint interval
    proc.start()
    with httpx.Client(base_url=proc.url, timeout=10) as http:
        post(http, "/v1/messages", {"messages": [{"id": "new", "subject": "s", "body": "x"}]})
        served = pull(http, "s", "late", start="latest").json()["messages"]
        assert [m["id"] for m in served] == ["new"]


@pytest.mark.parametrize("stop", ["kill9", "terminate"])
def test_empty_subjects_and_groups_survive_restarts(
    broker_factory: type[BrokerProcess], tmp_path: Path, stop: str
) -> None:
    proc = broker_factory(tmp_path / "d").start()
    with httpx.Client(base_url=proc.url, timeout=10) as http:
        assert pull(http, "quiet", "g").json()["messages"] == []
        assert pull(http, "quiet", "fan", "c1", mode="broadcast").status_code == 200
    getattr(proc, stop)()
    proc.start()
    for _ in range(2):  # and again after the checkpoint the restart wrote
        with httpx.Client(base_url=proc.url, timeout=10) as http:
            listed = http.get("/v1/subjects").json()["subjects"]
            assert [s["subject"] for s in listed] == ["quiet"]
            groups = http.get("/v1/subjects/quiet").json()["groups"]
            assert sorted((g["group"], g["mode"]) for g in groups) == [
                ("fan", "broadcast"),
                ("g", "shared"),
            ]
        proc.terminate()
        proc.start()


# --- 6. rights per subject and group; leases are owned ------------------------------------


def test_rights_per_subject_and_group(authed: BrokerProcess) -> None:
    def as_(token: str) -> httpx.Client:
        return httpx.Client(
            base_url=authed.url, timeout=10, headers={"authorization": f"Bearer {token}"}
        )

    with as_("t-root") as root:
        for subject in ("order.created", "pay.done"):
            doc = {"messages": [{"id": f"{subject}-1", "subject": subject, "body": "x"}]}
            assert post(root, "/v1/messages", doc).status_code == 200
        assert pull(root, "order.created", "shipping").status_code == 200
    with as_("t-billing") as billing:
        assert pull(billing, "order.created", "billing").status_code == 200
        assert error(pull(billing, "order.created", "shipping")) == (403, "forbidden", "group")
        assert error(pull(billing, "pay.done", "billing")) == (403, "forbidden", "group")
        listed = billing.get("/v1/subjects").json()["subjects"]
        assert [s["subject"] for s in listed] == ["order.created"]
        groups = billing.get("/v1/subjects/order.created").json()["groups"]
        assert [g["group"] for g in groups] == ["billing"]
        assert error(billing.get("/v1/subjects/pay.done"))[:2] == (403, "forbidden")
        dead = "/v1/subjects/order.created/groups/billing/dead"
        assert error(billing.get(dead))[:2] == (403, "forbidden")
        assert error(post(billing, f"{dead}/redrive", {"all": True}))[:2] == (403, "forbidden")
        assert error(billing.get("/v1/schedule"))[:2] == (403, "forbidden")
    with as_("t-produce") as producer:
        listed = producer.get("/v1/subjects").json()["subjects"]
        assert [s["subject"] for s in listed] == ["order.created"]
        assert producer.get("/v1/subjects/order.created").json()["groups"] == []
        assert error(producer.get("/v1/schedule"))[:2] == (403, "forbidden")
        assert error(pull(producer, "order.created", "billing"))[:2] == (403, "forbidden")
    with as_("t-audit") as auditor:
        dead = "/v1/subjects/order.created/groups/billing/dead"
        assert auditor.get(dead).status_code == 200
        assert post(auditor, f"{dead}/redrive", {"all": True}).status_code == 200
        other = "/v1/subjects/order.created/groups/shipping/dead"
        assert error(auditor.get(other)) == (403, "forbidden", "group")
        assert error(auditor.get("/v1/schedule"))[:2] == (403, "forbidden")
        assert error(pull(auditor, "order.created", "billing"))[:2] == (403, "forbidden")
    with as_("t-ops") as ops:
        assert ops.get("/v1/schedule").status_code == 200
        assert ops.get("/v1/subjects/pay.done/groups/any/dead").status_code == 404
        assert [s["subject"] for s in ops.get("/v1/subjects").json()["subjects"]] == [
            "order.created",
            "pay.done",
        ]


def test_only_the_lease_holder_may_ack_or_nack(broker: BrokerProcess) -> None:
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        post(http, "/v1/messages", {"messages": [{"id": "a", "subject": "s", "body": "x"}]})
        (message,) = pull(http, "s", "g", "holder").json()["messages"]
        seqs = [message["seq"]]
        base = {"subject": "s", "group": "g", "seqs": seqs}
        stranger = post(http, "/v1/ack", {**base, "consumer": "stranger"}).json()
        assert stranger == {"acked": 0, "unknown": seqs}
        nacked = post(http, "/v1/nack", {**base, "consumer": "stranger"}).json()
        assert nacked == {"retrying": 0, "dead": 0}
        holder = post(http, "/v1/ack", {**base, "consumer": "holder"}).json()
        assert holder == {"acked": 1, "unknown": []}


# --- 7. query parameters ----------------------------------------------------------------


@pytest.mark.parametrize(
    "query", ["limit=%C2%B2", "limit=1&limit=2", "limit=" + "9" * 30, "limit=-1", "limit=+3"]
)
def test_query_parameters_are_ascii_digits_in_range(broker: BrokerProcess, query: str) -> None:
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        post(http, "/v1/messages", {"messages": [{"id": "a", "subject": "s", "body": "x"}]})
        pull(http, "s", "g")
        for path in ("/v1/subjects/s/groups/g/dead", "/v1/schedule"):
            assert error(http.get(f"{path}?{query}")) == (400, "invalid_limit", "limit")
        after = http.get("/v1/subjects/s/groups/g/dead?after_seq=%C2%B2")
        assert error(after) == (400, "invalid_after_seq", "after_seq")


# --- 10. 405 names what is allowed --------------------------------------------------------


def test_405_carries_allow(broker: BrokerProcess) -> None:
    with httpx.Client(base_url=broker.url, timeout=10) as http:
        wrong = http.get("/v1/messages")
        assert error(wrong)[:2] == (405, "method_not_allowed")
        assert wrong.headers["allow"] == "POST"
        assert "GET" in http.delete("/v1/subjects").headers["allow"]


def test_parallel_poison_does_not_take_down_a_subject(broker: BrokerProcess) -> None:
    """Good and bad batches at once: every good message is served, every bad batch is 400."""

    async def main() -> None:
        async with httpx.AsyncClient(base_url=broker.url, timeout=10, headers=JSON) as http:

            async def send(i: int) -> int:
                created = "9999-12-31T23:59:59-23:59" if i % 2 else "2026-01-01T00:00:00Z"
                doc = {
                    "messages": [
                        {"id": f"m{i}", "subject": "s", "body": "x", "created_at": created}
                    ]
                }
                return (await http.post("/v1/messages", content=orjson.dumps(doc))).status_code

            codes = await asyncio.gather(*(send(i) for i in range(40)))
            assert sorted(set(codes)) == [200, 400]
            doc = {"subject": "s", "group": "g", "consumer": "c", "max": 100}
            answer = await http.post("/v1/pull", content=orjson.dumps(doc))
            assert answer.status_code == 200
            assert len(answer.json()["messages"]) == 20

    asyncio.run(main())
