"""Rebuild one sealed index chunk from the message log, when its CRC fails on first read.

Sealed chunks are checked when the broker first reads each one (``ChunkReader``), not at
start-up, so start-up time does not grow with the history. A chunk that fails its check is
rebuilt here from the message records of its subject and seq range, searched in the
segments between its neighbours' entries (or every segment, when a neighbour is missing
or makes no sense). A seq whose record is not found gets an entry that reads as
unreadable, as recovery gives it: seqs are never handed out twice.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from qmq_broker.format.files import SegmentKind, list_segments, segment_number
from qmq_broker.format.frames import FRAME_SIZE, BadRegion, walk_frames
from qmq_broker.format.ids import id_hash
from qmq_broker.format.index import (
    INDEX_CHUNK_ENTRIES,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    index_chunk_path,
)
from qmq_broker.format.messages import MessageRecord, is_message_record
from qmq_broker.storage.index_files import write_chunk

logger = logging.getLogger(__name__)


def rebuild_chunk(data_dir: Path, subject: str, start: int) -> int:
    """Rewrite chunk ``start`` of ``subject`` from the log; returns how many of its seqs
    were found there."""
    segments = list_segments(data_dir, SegmentKind.MESSAGES)
    numbers = [segment_number(path) for path in segments]
    low = _neighbour_segment(data_dir, subject, start - INDEX_CHUNK_ENTRIES, last=True)
    high = _neighbour_segment(data_dir, subject, start + INDEX_CHUNK_ENTRIES, last=False)
    if low is None or high is None or low > high:
        low, high = min(numbers, default=0), max(numbers, default=0)
    found: dict[int, bytes] = {}
    for path, number in zip(segments, numbers, strict=True):
        if not low <= number <= high:
            continue
        for item in walk_frames(path.read_bytes(), check=is_message_record):
            if isinstance(item, BadRegion):
                continue
            offset, payload = item
            record = MessageRecord.decode(payload, path=str(path), offset=offset)
            if record.subject == subject and start <= record.seq < start + INDEX_CHUNK_ENTRIES:
                found[record.seq] = INDEX_ENTRY.pack(
                    number,
                    FRAME_SIZE + len(payload),
                    offset,
                    record.stored_at_us,
                    id_hash(record.id),
                )
    unreadable = INDEX_ENTRY.pack(low, FRAME_SIZE, 0, 0, 0)  # a segment header: no frame
    entries = b"".join(
        found.get(seq, unreadable) for seq in range(start, start + INDEX_CHUNK_ENTRIES)
    )
    write_chunk(data_dir, subject, start, entries)
    logger.error(
        "index chunk failed its CRC; rebuilt from the log",
        extra={
            "action": "broker.index_chunk_rebuilt",
            "subject": subject,
            "chunk": start,
            "found": len(found),
            "unreadable": INDEX_CHUNK_ENTRIES - len(found),
        },
    )
    return len(found)


def _neighbour_segment(data_dir: Path, subject: str, start: int, *, last: bool) -> int | None:
    """The segment of the last (or first) entry of a neighbouring chunk, if it has one."""
    if start < 0:
        return None
    try:
        fd = os.open(index_chunk_path(data_dir, subject, start), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size - INDEX_HEADER.size
        count = size // INDEX_ENTRY_SIZE
        if count <= 0:
            return None
        at = INDEX_HEADER.size + ((count - 1) if last else 0) * INDEX_ENTRY_SIZE
        raw = os.pread(fd, INDEX_ENTRY_SIZE, at)
    finally:
        os.close(fd)
    segment: int = INDEX_ENTRY.unpack(raw)[0]
    return segment
