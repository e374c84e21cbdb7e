"""Broker data directories written with the format module's primitives (no broker)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qmq_broker.format import HEADER_SIZE, ActionRecord, MessageRecord, SegmentKind
from qmq_broker.format.files import segment_header, segment_name
from qmq_broker.format.frames import FRAME_SIZE, frame

US = 1_000_000
T0 = 1_735_732_800 * US  # 2025-01-01T12:00:00Z


def message(seq: int, *, id: str | None = None, body: bytes = b"{}", **kw: object) -> MessageRecord:
    fields: dict[str, object] = {
        "seq": seq,
        "id": id or f"m{seq}",
        "subject": "orders",
        "key": None,
        "headers": {},
        "body": body,
        "body_base64": False,
        "producer": "orders-svc",
        "created_at_us": T0 + seq,
        "stored_at_us": T0 + seq + 1000,
        "deliver_at_us": 0,
    }
    fields.update(kw)
    return MessageRecord(**fields)  # type: ignore[arg-type]


def write_segment(
    data_dir: Path,
    kind: SegmentKind,
    number: int,
    records: Sequence[MessageRecord | ActionRecord],
    *,
    tail: bytes = b"",
) -> Path:
    folder = data_dir / ("messages" if kind is SegmentKind.MESSAGES else "actions")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / segment_name(number)
    frames = b"".join(frame(r.encode()) for r in records)
    path.write_bytes(segment_header(kind) + frames + tail)
    (data_dir / "FORMAT").write_text('{"format": 1}')
    return path


def frame_offsets(records: Sequence[MessageRecord | ActionRecord]) -> list[tuple[int, int]]:
    """``(offset, length)`` of each record's frame in a segment written by ``write_segment``."""
    found, offset = [], HEADER_SIZE
    for record in records:
        length = FRAME_SIZE + len(record.encode())
        found.append((offset, length))
        offset += length
    return found


def flip_byte(path: Path, at: int) -> None:
    """Damage one byte of a file in place (all its bits inverted)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
