"""Randomized damage campaign: one bit flip or cut in a random file of a real data dir.

A real broker process writes plain, ordered, delayed and acked messages and is killed with
``kill -9``. Each trial copies that data dir, damages one random file once (a flipped bit,
or a cut at a random offset), runs ``verify``, then starts a broker on it (with
``--on-damage skip`` when it refuses) and reads everything back over HTTP. Asserted: no
hang (the per-test timeout), no message whose frame is intact is lost, nothing is served
twice or with a wrong body, no seq is handed out again, and verify's count of unreadable
messages equals what the broker lost. Delayed messages are checked by what is still
scheduled. Every other trial reads back with pulls answered as records, as the SDK's are.
Reproduce one trial: ``pytest tests/acceptance/test_damage_campaign.py -k
"trial-17" -m slow``; ``-s`` prints what each trial damaged.
"""

from __future__ import annotations

import asyncio
import datetime
import random
import shutil
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from qmq_broker.config import BrokerConfig, FsyncPolicy
from qmq_broker.delayed.recovery import recover_schedule
from qmq_broker.engine import Broker
from qmq_broker.errors import QmqBrokerError
from qmq_broker.format import FORMAT_FILE, HEADER_SIZE
from qmq_broker.format.index import list_indexed_subjects
from qmq_broker.http.app import create_app
from qmq_broker.metrics import BrokerMetrics
from qmq_broker.recovery.verify import verify
from qmq_broker.recovery.verify_log import read_index
from qmq_wire.records import RECORDS_MEDIA_TYPE, read_records_answer
from tests.support.broker_process import BrokerProcess

PLAIN, ORDERED, DELAYED = "plain", "ordered", "delayed"
PLAIN_COUNT, ORDERED_COUNT, DELAYED_COUNT = 1_200, 400, 100
TRIALS = 500
DELAYED_DIRS = {"schedule", "schedule-days", "schedule-32days", "dispatch"}
Where = dict[tuple[int, int], list[tuple[str, int, int]]]  # (segment, offset): (log, seq, length)


def body(message_id: str) -> str:
    return f"{message_id}:".ljust(1_500, "b")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data dir every trial damages a copy of: written by a real broker, then kill -9."""
    data_dir = tmp_path_factory.mktemp("campaign") / "data"
    broker = BrokerProcess(
        data_dir, extra_args=["--segment-size", "1048576", "--checkpoint-interval", "1h"]
    ).start()
    url = broker.url
    try:
        declared = httpx.put(
            f"{url}/v1/subjects/{ORDERED}", json={"ordered": True, "partitions": 2}
        )
        assert declared.status_code == 200, declared.text
        later = datetime.datetime.now(datetime.UTC)
        for start in range(0, PLAIN_COUNT, 100):
            produce(url, [_message(PLAIN, i) for i in range(start, start + 100)])
            if start == 600:  # acked and leased messages, and a checkpoint-free tail after them
                pulled = pull(url, PLAIN, "g", 300)
                pull(url, PLAIN, "g", 0, ack=[m["seq"] for m in pulled[:200]])
        for start in range(0, ORDERED_COUNT, 100):
            produce(
                url,
                [{**_message(ORDERED, i), "key": f"k{i % 13}"} for i in range(start, start + 100)],
            )
        delays = [datetime.timedelta(hours=2), datetime.timedelta(days=3)]
        produce(
            url,
            [
                {**_message(DELAYED, i), "deliver_at": (later + delays[i % 2]).isoformat()}
                for i in range(DELAYED_COUNT)
            ],
        )
        broker.kill9()
    finally:
        broker.stop()
    return data_dir


def _message(subject: str, i: int) -> dict[str, Any]:
    message_id = f"{subject}-{i}"
    return {"id": message_id, "subject": subject, "body": body(message_id)}


def produce(url: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    answer = httpx.post(f"{url}/v1/messages", json={"messages": messages}, timeout=30)
    assert answer.status_code == 200, answer.text
    results: list[dict[str, Any]] = answer.json()["results"]
    return results


def pull(
    url: str, subject: str, group: str, count: int, *, ack: list[int] | None = None
) -> list[dict[str, Any]]:
    request: dict[str, Any] = {"subject": subject, "group": group, "consumer": "c"}
    request["max"] = max(count, 1)
    if ack:
        request["ack"] = ack
    answer = httpx.post(f"{url}/v1/pull", json=request, timeout=30)
    assert answer.status_code == 200, answer.text
    messages: list[dict[str, Any]] = answer.json()["messages"]
    return messages


# --- damage --------------------------------------------------------------------------------


def positions(data_dir: Path) -> Where:
    """Where each stored record is, from the index of the undamaged data dir."""
    found: Where = {}
    for log in list_indexed_subjects(data_dir):
        for seq, entry in read_index(data_dir, log).items():
            found.setdefault((entry.segment, entry.offset), []).append((log, seq, entry.length))
    return found


def damage(data_dir: Path, rng: random.Random) -> tuple[str, Path, int]:
    """Flip one bit of, or cut, one random file; returns (what, file, offset)."""
    files = sorted(p for p in data_dir.rglob("*") if p.is_file() and p.stat().st_size > 0)
    path = rng.choice(files)
    size = path.stat().st_size
    offset = rng.randrange(size)
    if path.parent.name == "messages" and rng.random() < 0.8:  # the written part, not room
        written = len(path.read_bytes().rstrip(b"\x00"))
        offset = rng.randrange(min(written, size)) if written else offset
    if rng.random() < 0.5:
        data = bytearray(path.read_bytes())
        data[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return "flip", path, offset
    with open(path, "r+b") as handle:
        handle.truncate(offset)
    return "cut", path, offset


def hit(what: str, path: Path, offset: int, where: Where) -> set[tuple[str, int]]:
    """The records whose frame the damage touched (none outside message segments)."""
    if path.parent.name != "messages" or (offset < HEADER_SIZE and what == "flip"):
        return set()
    segment = int(path.stem)
    touched = set()
    for (seg, start), records in where.items():
        for log, seq, length in records:
            if seg != segment:
                continue
            if (what == "flip" and start <= offset < start + length) or (
                what == "cut" and start + length > offset
            ):
                touched.add((log, seq))
    return touched


# --- the broker after the damage ------------------------------------------------------------


async def read_back(data_dir: Path, on_damage: str, *, records: bool = False) -> dict[str, Any]:
    broker = Broker(
        BrokerConfig(data_dir=data_dir, fsync=FsyncPolicy(mode="never"), on_damage=on_damage),
        metrics=BrokerMetrics(),
    )
    await broker.start()
    try:
        transport = httpx.ASGITransport(app=create_app(broker))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await _read_all(client, records)
    finally:
        await broker.close()


async def _drain(
    client: httpx.AsyncClient, subject: str, *, ordered: bool, records: bool
) -> tuple[list[dict[str, Any]], int]:
    """Everything group ``fresh`` gets, acked; and how many it dead-lettered. ``records``:
    pulls answered with the records as stored (what the SDK asks for), not JSON."""
    served: list[dict[str, Any]] = []
    mode = {"mode": "ordered"} if ordered else {}
    accept = {"accept": RECORDS_MEDIA_TYPE} if records else {}
    for _ in range(10_000):
        answer = await client.post(
            "/v1/pull",
            json={"subject": subject, "group": "fresh", "consumer": "c", "max": 500, **mode},
            headers=accept,
        )
        assert answer.status_code == 200, answer.text
        batch = _messages(answer.content) if records else answer.json()["messages"]
        if not batch:
            break
        served += batch
        by_partition: dict[int | None, list[int]] = {}
        for m in batch:
            by_partition.setdefault(m.get("partition"), []).append(m["seq"])
        for partition, seqs in by_partition.items():
            extra = {} if partition is None else {"partition": partition}
            request = {"subject": subject, "group": "fresh", "consumer": "c", "seqs": seqs}
            acked = await client.post("/v1/ack", json={**request, **extra})
            assert acked.status_code == 200, acked.text
    stats = (await client.get(f"/v1/subjects/{subject}")).json()
    dead = sum(g["dead"] for g in stats["groups"] if g["group"] == "fresh")
    return served, dead


def _messages(content: bytes) -> list[dict[str, Any]]:
    """A records answer's messages as the JSON answer shows the fields checked here."""
    _, entries = read_records_answer(content, orjson.loads)
    return [
        {"seq": fields[0], "id": fields[6], "body": fields[10].decode(), "partition": partition}
        for _, partition, fields in entries
    ]


async def _read_all(client: httpx.AsyncClient, records: bool) -> dict[str, Any]:
    plain, plain_dead = await _drain(client, PLAIN, ordered=False, records=records)
    ordered, ordered_dead = await _drain(client, ORDERED, ordered=True, records=records)
    # nothing more for the same group
    again, _ = await _drain(client, PLAIN, ordered=False, records=records)
    stored = (
        await client.post(
            "/v1/messages",
            json={"messages": [_message(PLAIN, 10**6), {**_message(ORDERED, 10**6), "key": "k0"}]},
        )
    ).json()["results"]
    scheduled = (await client.get(f"/v1/subjects/{DELAYED}")).json()["scheduled"]
    scheduled["unreadable"] = (await client.get("/v1/schedule")).json()["unreadable"]
    return {
        "served": plain + ordered,
        "dead": plain_dead + ordered_dead,
        "again": again,
        "stored": stored,
        "scheduled": scheduled,
    }


def trial(template: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    shutil.copytree(template, data_dir)
    where = positions(data_dir)
    top: dict[str, int] = {}
    for (_, _), records in where.items():
        for log, seq, _ in records:
            top[log] = max(top.get(log, -1), seq)
    what, path, offset = damage(data_dir, rng)
    touched = hit(what, path, offset, where)
    if path.name == FORMAT_FILE:  # no data dir of a known format: both refuse, naming it
        with pytest.raises(QmqBrokerError, match=r"(?i)format"):
            verify(data_dir)
        with pytest.raises(QmqBrokerError, match=r"(?i)format"):
            asyncio.run(read_back(data_dir, "skip"))
        return
    counted = verify(data_dir).unreadable
    schedule = recover_schedule(data_dir, on_damage="skip", write=False)  # as verify reads it
    print(f"trial {seed}: {what} {path.relative_to(data_dir)} at {offset}; hit {len(touched)}")
    as_records = seed % 2 == 1  # every other trial reads back as the SDK does
    try:
        result = asyncio.run(read_back(data_dir, "fail", records=as_records))
    except QmqBrokerError as exc:
        refused = str(exc)
        result = asyncio.run(read_back(data_dir, "skip", records=as_records))
    else:
        refused = ""
    assert not refused or "--on-damage skip" in refused or path.name in refused, refused

    served = result["served"]
    ids = [m["id"] for m in served]
    assert len(ids) == len(set(ids)), "a message served twice"
    assert not result["again"], "a group got a message again after acking it"
    for m in served:
        assert m["body"] == body(m["id"]), f"a wrong body for {m['id']}"
    expected = {f"{PLAIN}-{i}" for i in range(PLAIN_COUNT)} | {
        f"{ORDERED}-{i}" for i in range(ORDERED_COUNT)
    }
    lost = expected - set(ids)
    assert len(lost) <= len(touched), f"intact messages lost: {sorted(lost)[:10]}"
    assert counted == len(lost), f"verify counted {counted}, the broker lost {len(lost)}"
    assert result["dead"] == len(lost), f"{result['dead']} dead-lettered, {len(lost)} lost"
    for answer in result["stored"]:
        log = answer["subject"] + (f"#{answer['partition']}" if "partition" in answer else "")
        assert answer["status"] == "stored", answer
        assert answer["seq"] > top.get(log, -1), f"seq {answer['seq']} of {log} handed out again"
    pending = schedule.subjects.get(DELAYED, [0])[0]
    reported = sum(lost.records for lost in schedule.unreadable if lost.lost)
    if path.parent.name not in DELAYED_DIRS:
        assert pending == DELAYED_COUNT, f"{DELAYED_COUNT - pending} delayed messages lost"
    # a flip costs the record hit; a cut, what follows it: each counted (its tally's evidence)
    assert pending + reported == DELAYED_COUNT, f"{DELAYED_COUNT - pending} delayed lost"
    started = result["scheduled"]
    assert started["messages"] == pending, started
    assert started["unreadable"] == reported, f"the broker counted {started}, verify {reported}"
    if what == "cut" and reported:
        print(f"trial {seed}: {reported} delayed messages lost to the cut, counted")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(TRIALS), ids=lambda s: f"trial-{s}")
def test_one_random_damage(template: Path, tmp_path: Path, seed: int) -> None:
    trial(template, tmp_path, seed)
