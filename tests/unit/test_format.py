"""Record encode/decode, framing and CRC checks of the on-disk format."""

from __future__ import annotations

import zlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qmq_broker.errors import CorruptRecord, StorageError
from qmq_broker.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    ActionRecord,
    ActionType,
    BadRegion,
    MessageRecord,
    SegmentKind,
    iter_frames,
    iter_message_records,
    read_format,
    read_segment_header,
    walk_frames,
)
from qmq_broker.format.files import segment_header
from qmq_broker.format.frames import FRAME, FRAME_SIZE, crc32, frame, read_frame_at
from qmq_broker.format.index import IndexEntry
from qmq_broker.format.messages import is_message_record, message_frames
from qmq_broker.messages import IncomingMessage, rfc3339

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


@given(st.binary(max_size=5000), st.integers(min_value=0, max_value=2**32 - 1))
def test_the_frames_crc_is_zlibs(data: bytes, start: int) -> None:
    """Every data directory's frames were checksummed with zlib's CRC-32: whatever computes
    it now must give the same values, continued from any running value."""
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, start) == zlib.crc32(data, start)


def test_a_frame_written_with_zlibs_crc_reads_back() -> None:
    payload = bytes(range(256)) * 8
    written = FRAME.pack(len(payload), zlib.crc32(payload)) + payload
    assert read_frame_at(written, offset=0, path="x") == payload


def message_frame(seq: int, body: bytes = b"x" * 40) -> bytes:
    return frame(
        record(
            seq=seq,
            id=f"m-{seq}",
            subject="s",
            key=None,
            headers={},
            body=body,
            producer=None,
            created_at_us=1,
            stored_at_us=2,
        ).encode()
    )


def test_the_produce_paths_frames_are_the_frames_of_the_records() -> None:
    expected = [
        record(seq=10 + n, body=body, key=key, headers=headers, producer=producer, **extra)
        for n, (body, key, headers, producer, extra) in enumerate(
            [
                (b"", "k", {"h": "v"}, "p", {}),
                (b"x", None, {}, None, {"body_base64": True, "deliver_at_us": 5}),
                (bytes(range(256)) * 40, "k\u00e9", {"a": "1", "b": "2"}, "p", {}),
                (b"no created time", None, {}, None, {"created_at_us": 1_700_000_000_000_123}),
                (b"tagged", "k", {}, None, {"tags": ("red", "a.b:c-d_e")}),
            ]
        )
    ]
    incoming = [
        IncomingMessage(
            id=r.id,
            subject=r.subject,
            key=r.key,
            headers=r.headers,
            body=r.body,
            body_base64=r.body_base64,
            producer=r.producer,
            # the last one came with no created time: it takes the stored time
            created_at_us=None if n == 3 else r.created_at_us,
            deliver_at_us=r.deliver_at_us,
            tags=r.tags,
        )
        for n, r in enumerate(expected)
    ]
    framed = message_frames(
        incoming, subject="order.created", first_seq=10, stored_at_us=1_700_000_000_000_123
    )
    assert framed == [frame(r.encode()) for r in expected]
    for one, want in zip(framed, expected, strict=True):
        payload = read_frame_at(one, offset=0, path="x")
        assert MessageRecord.decode(payload, path="x", offset=0) == want


def walk(data: bytes) -> list[tuple[int, bytes] | BadRegion]:
    return list(walk_frames(data, check=is_message_record))


def test_a_torn_tail_is_a_bad_region_that_nothing_valid_follows() -> None:
    whole = segment_header(SegmentKind.MESSAGES) + frame(b"a" * 10) + frame(b"b" * 20)
    torn = whole + frame(b"c" * 30)[:-5]
    items = list(walk_frames(torn))
    assert [i[1] for i in items if not isinstance(i, BadRegion)] == [b"a" * 10, b"b" * 20]
    assert items[-1] == BadRegion(len(whole), len(torn), torn=True)
    assert [p for _, p in iter_frames(torn, path="t")] == [b"a" * 10, b"b" * 20]


def test_a_bad_crc_is_never_yielded() -> None:
    good = frame(b"x" * 8)
    bad = bytearray(frame(b"y" * 8))
    bad[4:8] = (zlib.crc32(b"z") & 0xFFFFFFFF).to_bytes(4, "little")
    data = segment_header(SegmentKind.MESSAGES) + good + bytes(bad)
    assert [p for _, p in iter_frames(data, path="t")] == [b"x" * 8]
    assert list(walk_frames(data))[1] == BadRegion(HEADER_SIZE + len(good), len(data), torn=True)


@pytest.mark.parametrize("where", ["length", "crc", "payload"])
def test_a_flipped_bit_costs_only_the_frame_it_hit(where: str) -> None:
    frames = [message_frame(seq) for seq in range(6)]
    data = bytearray(segment_header(SegmentKind.MESSAGES) + b"".join(frames))
    hit = HEADER_SIZE + sum(len(f) for f in frames[:2])  # frame of seq 2
    data[hit + {"length": 1, "crc": 5, "payload": FRAME_SIZE + 20}[where]] ^= 0x10
    items = walk(bytes(data))
    seqs = [MessageRecord.decode(i[1]).seq for i in items if not isinstance(i, BadRegion)]
    assert seqs == [0, 1, 3, 4, 5]
    (bad,) = [i for i in items if isinstance(i, BadRegion)]
    assert (bad.start, bad.end, bad.torn) == (hit, hit + len(frames[2]), False)


def test_resync_needs_a_frame_that_decodes_and_chains_on() -> None:
    # A body that holds a whole framed record: after damage just before it, the walk must
    # not take the embedded frame for the next record (it does not chain on to another).
    inner = message_frame(99, b"inner")
    frames = [message_frame(0), message_frame(1, b"<" + inner + b">"), message_frame(2)]
    data = bytearray(segment_header(SegmentKind.MESSAGES) + b"".join(frames))
    data[HEADER_SIZE + len(frames[0]) + 6] ^= 0x01  # the CRC of seq 1's frame
    items = walk(bytes(data))
    seqs = [MessageRecord.decode(i[1]).seq for i in items if not isinstance(i, BadRegion)]
    assert seqs == [0, 2]


def test_zero_room_after_the_last_frame_ends_the_walk_quietly() -> None:
    frames = [message_frame(seq) for seq in range(3)]
    data = segment_header(SegmentKind.MESSAGES) + b"".join(frames) + bytes(64 * 1024)
    items = walk(data)
    assert len(items) == 3
    assert not any(isinstance(i, BadRegion) for i in items)  # the room is no region
    assert [p for _, p in iter_frames(data, path="t")] == [f[FRAME_SIZE:] for f in frames]


def test_a_write_torn_into_the_room_is_still_a_torn_tail() -> None:
    whole = segment_header(SegmentKind.MESSAGES) + message_frame(0)
    data = whole + message_frame(1)[:-7] + bytes(64 * 1024)  # half of it reached the room
    items = walk(data)
    assert isinstance(items[-1], BadRegion)
    assert (items[-1].start, items[-1].end, items[-1].torn) == (len(whole), len(data), True)


def test_damage_then_a_long_run_of_zeros_then_frames_is_read_past() -> None:
    # the resync skips a zero run at once (no frame has length 0) instead of byte by byte
    head = segment_header(SegmentKind.MESSAGES) + message_frame(0)
    damaged = bytearray(message_frame(1))
    damaged[6] ^= 0x01
    tail = message_frame(2) + message_frame(3)
    data = head + bytes(damaged) + bytes(8 * 1024 * 1024) + tail + bytes(4096)
    items = walk(data)
    seqs = [MessageRecord.decode(i[1]).seq for i in items if not isinstance(i, BadRegion)]
    assert seqs == [0, 2, 3]
    (bad,) = [i for i in items if isinstance(i, BadRegion)]
    assert (bad.start, bad.end, bad.torn) == (len(head), len(data) - len(tail) - 4096, False)


def test_the_last_frame_may_end_in_zero_bytes_before_the_room() -> None:
    # a body ending in zeros is not room: the frame's length says where it ends
    frames = [message_frame(0, b"x\x00\x00\x00"), message_frame(1, b"\x00" * 40)]
    data = segment_header(SegmentKind.MESSAGES) + b"".join(frames) + bytes(1000)
    assert [MessageRecord.decode(p).body for _, p in iter_frames(data, path="t")] == [
        b"x\x00\x00\x00",
        b"\x00" * 40,
    ]


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


@given(st.integers(min_value=-62_135_596_800_000_000, max_value=253_402_300_799_999_999))
def test_rfc3339_is_the_isoformat_of_the_instant(micros: int) -> None:
    instant = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)
    expected = instant.isoformat(timespec="microseconds").replace("+00:00", "Z")
    assert rfc3339(micros) == expected


def test_rfc3339_refuses_what_no_datetime_holds() -> None:
    for micros in (-62_135_596_800_000_001, 253_402_300_800_000_000):
        with pytest.raises(OverflowError):
            rfc3339(micros)


@pytest.mark.parametrize("content", [b'{"formbt": 4}', b'{"format": 4', b"\x00\x01"])
def test_a_damaged_format_file_names_itself_and_the_fix(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "FORMAT").write_bytes(content)
    with pytest.raises(StorageError) as raised:
        read_format(tmp_path)
    message = str(raised.value)
    assert str(tmp_path / "FORMAT") in message
    assert f"""echo '{{"format": {FORMAT_VERSION}}}' > {tmp_path / "FORMAT"}""" in message
    assert f"qmq broker verify --data-dir {tmp_path}" in message
