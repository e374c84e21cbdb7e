"""``qmq_wire.records``: the message record decoder the broker and the SDK share, and the
framing of records answers."""

from __future__ import annotations

import json

import orjson
import pytest

from qmq_broker.format.messages import MessageRecord
from qmq_wire.records import (
    RecordError,
    decode_message,
    is_records_answer,
    read_records_answer,
    records_answer,
    records_entry,
)


def _record(seq: int, **overrides: object) -> bytes:
    fields: dict[str, object] = {
        "seq": seq,
        "id": f"m-{seq}",
        "subject": "s",
        "key": None,
        "headers": {"h": "v"},
        "body": b"body",
        "body_base64": False,
        "producer": None,
        "created_at_us": 1,
        "stored_at_us": 2,
        "deliver_at_us": 0,
    }
    fields.update(overrides)
    return MessageRecord(**fields).encode()  # type: ignore[arg-type]


def test_the_decoder_reads_what_the_broker_encodes_with_either_json_parser() -> None:
    payload = _record(3, key="k", producer="p", tags=("a", "b"), body_base64=True)
    expected = (3, 3, 1, 2, 0, "s", "m-3", "k", "p", {"h": "v"}, b"body", ("a", "b"))
    assert decode_message(payload, orjson.loads) == expected
    assert decode_message(payload, json.loads) == expected


@pytest.mark.parametrize("cut", [1, 10, 40])
def test_a_cut_record_is_a_record_error(cut: int) -> None:
    payload = _record(1)
    with pytest.raises(RecordError):
        decode_message(payload[:-cut], orjson.loads)


def test_an_answer_round_trips_with_attempts_and_partitions() -> None:
    entries = [records_entry(1, None, _record(0)), records_entry(3, 2, _record(1))]
    content = records_answer(orjson.dumps({"acked": 1, "unknown": []}), entries)
    assert is_records_answer(content)
    fields, messages = read_records_answer(content, orjson.loads)
    assert fields == {"acked": 1, "unknown": []}
    assert [(a, p, m[0], m[6]) for a, p, m in messages] == [(1, None, 0, "m-0"), (3, 2, 1, "m-1")]


def test_an_empty_answer_reads() -> None:
    assert read_records_answer(records_answer(b"{}", []), orjson.loads) == ({}, [])


@pytest.mark.parametrize(
    "damage",
    [
        lambda c: c[:-1],  # cut short
        lambda c: c + b"x",  # trailing bytes
        lambda c: b"QMQX" + c[4:],  # not the magic
        lambda c: b'{"messages": []}',  # JSON
    ],
)
def test_an_answer_that_does_not_read_is_a_record_error(damage: object) -> None:
    content = records_answer(b"{}", [records_entry(1, None, _record(0))])
    with pytest.raises(RecordError):
        read_records_answer(damage(content), orjson.loads)  # type: ignore[operator]
