"""Record encode/decode, framing and CRC checks of the on-disk format."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.errors import CorruptRecord
from broker.format import (
    FRAME_SIZE,
    HEADER_SIZE,
    ActionRecord,
    ActionType,
    IndexEntry,
    MessageRecord,
    SegmentKind,
    frame,
    iter_frames,
    iter_message_records,
    read_frame_at,
    read_segment_header,
    scan_frames,
    segment_header,
)

texts = st.text(min_size=0, max_size=50)


def record(**overrides: object) -> MessageRecord:
    fields: dict[str, object] = {
        "seq": 7,
        "id": "0193-abc",
        "subject": "order.created",
        "key": "42",
        "headers": {"traceparent": "00-abc-def-01"},
        "body": b'{"order_id": 42}',
        "body_base64": False,
        "producer": "orders",
        "created_at_us": 1_700_000_000_000_000,
        "stored_at_us": 1_700_000_000_000_123,
        "deliver_at_us": 0,
    }
    fields.update(overrides)
    return MessageRecord(**fields)  # type: ignore[arg-type]


@given(
    seq=st.integers(min_value=0, max_value=2**63 - 1),
    message_id=st.text(
        alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=128
    ),
    key=st.none() | texts,
    producer=st.none() | texts,
    headers=st.dictionaries(texts, texts, max_size=5),
    body=st.binary(max_size=2000),
    base64=st.booleans(),
)
def test_message_record_round_trips(
    seq: int,
    message_id: str,
    key: str | None,
    producer: str | None,
    headers: dict[str, str],
    body: bytes,
    base64: bool,
) -> None:
    original = record(
        seq=seq,
        id=message_id,
        key=key,
        producer=producer,
        headers=headers,
        body=body,
        body_base64=base64,
    )
    assert MessageRecord.decode(original.encode()) == original


def test_decode_of_garbage_names_the_location() -> None:
    with pytest.raises(CorruptRecord) as info:
        MessageRecord.decode(b"\x01\x00garbage", path="messages/3.seg", offset=99)
    assert info.value.path == "messages/3.seg"
    assert info.value.offset == 99


def test_action_record_round_trips() -> None:
    original = ActionRecord(
        type=ActionType.LEASE,
        at_us=5,
        subject="s",
        group="g",
        state="c1",
        seqs=(1, 2, 3),
        fields={"consumer": "c1", "deadline": 9, "attempts": [1, 1, 2]},
    )
    assert ActionRecord.decode(original.encode()) == original


def test_index_entry_round_trips() -> None:
    entry = IndexEntry(segment=3, offset=1 << 40, length=1100, stored_at_us=123, id_hash=2**64 - 1)
    assert IndexEntry.decode(entry.encode()) == entry


def test_frame_crc_detects_a_flipped_bit() -> None:
    framed = bytearray(frame(b"payload bytes"))
    assert read_frame_at(bytes(framed), offset=0, path="x") == b"payload bytes"
    framed[FRAME_SIZE + 3] ^= 0x01
    with pytest.raises(CorruptRecord, match="CRC"):
        read_frame_at(bytes(framed), offset=0, path="x")


def test_scan_stops_at_a_torn_tail() -> None:
    whole = segment_header(SegmentKind.MESSAGES) + frame(b"a" * 10) + frame(b"b" * 20)
    torn = whole + frame(b"c" * 30)[:-5]
    result = scan_frames(torn)
    assert result.valid_end == len(whole)
    assert result.problem is not None
    assert [p for _, p in iter_frames(torn, path="t")] == [b"a" * 10, b"b" * 20]


def test_scan_stops_at_a_bad_crc_and_never_yields_it() -> None:
    good = frame(b"x" * 8)
    bad = bytearray(frame(b"y" * 8))
    bad[4:8] = (zlib.crc32(b"z") & 0xFFFFFFFF).to_bytes(4, "little")
    data = segment_header(SegmentKind.MESSAGES) + good + bytes(bad)
    assert [p for _, p in iter_frames(data, path="t")] == [b"x" * 8]
    assert scan_frames(data).valid_end == HEADER_SIZE + len(good)


def test_segment_header_is_checked() -> None:
    assert read_segment_header(segment_header(SegmentKind.ACTIONS), path="p") is SegmentKind.ACTIONS
    with pytest.raises(CorruptRecord, match="magic"):
        read_segment_header(b"X" * 16, path="p")


def test_reader_reads_records_from_a_segment_file(tmp_path: Path) -> None:
    path = tmp_path / "00000000000000000000.seg"
    records = [record(seq=i, id=f"id-{i}") for i in range(3)]
    path.write_bytes(
        segment_header(SegmentKind.MESSAGES) + b"".join(frame(r.encode()) for r in records)
    )
    assert [r for _, r in iter_message_records(path)] == records
