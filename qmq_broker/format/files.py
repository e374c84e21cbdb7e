"""The data directory's files: the FORMAT file, segment headers, kinds and names.

Every segment starts with a 16-byte header (magic, kind, segment version); its frames
follow (``qmq_broker.format.frames``).
"""

from __future__ import annotations

import os
import struct
from enum import IntEnum
from pathlib import Path

import orjson

from qmq_broker.errors import CorruptRecord, StorageError

FORMAT_VERSION = 4  # of the data directory's layout (FORMAT, checkpoints, indexes, id hash, room)
SEGMENT_VERSION = 1  # of the segments' frames and records (unchanged since format 1)
SEGMENT_LAYOUT_FORMATS = (1, 2, 3, 4)  # data dir formats whose segments a reader can read
FORMAT_FILE = "FORMAT"  # {"format": N} at the top of a data directory


def read_format(data_dir: Path) -> int | None:
    """The format version ``data_dir``'s FORMAT file names; None when it has none.

    ``StorageError`` when the file cannot be read or does not hold ``{"format": N}``.
    """
    path = data_dir / FORMAT_FILE
    # A damaged FORMAT cannot be rebuilt from the data: the fix names the value this
    # broker writes, for the operator to confirm against the version that last ran here.
    fix = (
        f'if this broker version last ran here, write {{"format": {FORMAT_VERSION}}} into it '
        f"(echo '{{\"format\": {FORMAT_VERSION}}}' > {path}), then run "
        f"qmq broker verify --data-dir {data_dir}"
    )
    try:
        document = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as exc:
        raise StorageError(f"{path} is damaged ({exc}); {fix}") from exc
    except OSError as exc:
        raise StorageError(f"{path} cannot be read: {exc}") from exc
    version = document.get("format") if isinstance(document, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise StorageError(f'{path} does not hold {{"format": N}}; {fix}')
    return version


SEGMENT_MAGIC = b"QMQSEG\x00\x01"
HEADER = struct.Struct("<8sHHI")  # magic, kind, version, reserved
HEADER_SIZE = HEADER.size  # 16
SEGMENT_SUFFIX = ".seg"


class SegmentKind(IntEnum):
    MESSAGES = 1
    ACTIONS = 2
    SCHEDULE = 3
    DISPATCH = 4
    SCHEDULE_DAYS = 5
    SCHEDULE_32DAYS = 6


KIND_DIRS = {
    SegmentKind.MESSAGES: "messages",
    SegmentKind.ACTIONS: "actions",
    SegmentKind.SCHEDULE: "schedule",
    SegmentKind.DISPATCH: "dispatch",
    SegmentKind.SCHEDULE_DAYS: "schedule-days",
    SegmentKind.SCHEDULE_32DAYS: "schedule-32days",
}


def segment_header(kind: SegmentKind) -> bytes:
    return HEADER.pack(SEGMENT_MAGIC, int(kind), SEGMENT_VERSION, 0)


def read_segment_header(data: bytes, *, path: str) -> SegmentKind:
    """Check a segment header; raise ``CorruptRecord`` naming the file if it is not ours."""
    if len(data) < HEADER_SIZE:
        raise CorruptRecord(path=path, offset=0, reason="segment header cut short")
    magic, kind, version, _ = HEADER.unpack_from(data, 0)
    if magic != SEGMENT_MAGIC:
        raise CorruptRecord(path=path, offset=0, reason="not a qmq segment (bad magic)")
    if version != SEGMENT_VERSION:
        raise CorruptRecord(path=path, offset=0, reason=f"unsupported format version {version}")
    try:
        return SegmentKind(kind)
    except ValueError:
        raise CorruptRecord(path=path, offset=0, reason=f"unknown segment kind {kind}") from None


def read_segment(path: Path) -> tuple[bytes, SegmentKind]:
    """A segment file's bytes and kind, its header checked."""
    data = path.read_bytes()
    return data, read_segment_header(data, path=str(path))


def segment_name(number: int) -> str:
    return f"{number:020d}{SEGMENT_SUFFIX}"


def segment_number(path: Path) -> int:
    return int(path.name[: -len(SEGMENT_SUFFIX)])


def list_segments(data_dir: str | os.PathLike[str], kind: SegmentKind) -> list[Path]:
    """Segments of one kind in a data directory, oldest first."""
    folder = Path(data_dir) / KIND_DIRS[kind]
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.name.endswith(SEGMENT_SUFFIX)]
    return sorted(found, key=segment_number)
