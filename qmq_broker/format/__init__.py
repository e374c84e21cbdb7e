"""On-disk formats of the broker's data directory, readable without the broker running.

Layout of a data directory (format 4)::

    FORMAT                      {"format": 4}
    messages/<20 digits>.seg    message log segments, all subjects, append-only
    actions/<20 digits>.seg     action log segments (leases, acks, retries, dead letters)
    index/<subject>/<20 digits>.idx  a subject's index, seq -> (segment, offset, length),
                                in chunks of INDEX_CHUNK_ENTRIES seqs named by their first
                                seq; a chunk is deleted once retention removed every message
                                it points to
    dedup/<subject>/            the subject's dedup window: sorted runs of id hashes and a
                                filter (``qmq_broker.dedup``)
    schedule/<20 digits>.seg    delayed messages, one segment per hour of their due time
                                (the number is the hour since the Unix epoch), whole messages
    dispatch/<20 digits>.seg    which records of the same-numbered schedule segment went out
    schedule-days/<20 digits>.seg    delayed messages due after the current UTC day, one
                                segment per UTC day (day since the epoch); moved into hours
    schedule-32days/<20 digits>.seg  due further ahead still, one segment per 32 days
                                (32-day span since the epoch); moved into days
    checkpoint.json             positions up to which index and group state are saved
    checkpoint.prev.json        the checkpoint before it (both carry a CRC)

Format 1 kept each subject's whole index in one file, ``index/<subject>.idx``; format 2
split it into chunks; format 3 changed the id hash in index entries and dedup runs from
BLAKE2b-64 to XXH3-64 (``id_hash``); format 4 lets a log segment end in room (below). A
broker migrates an older data directory on start (``qmq_broker.recovery.migrate``).

Every segment starts with a 16-byte header (magic, kind, format version) and then holds
frames ``[u32 payload length][u32 crc32(payload)][payload]``. A frame that is cut short or
whose CRC does not match is never returned as a record; ``walk_frames`` reads on past it
(recovery truncates it only when nothing valid follows at the end of the last segment).

**Room** (format 4): the message and action logs' writer allocates its segment files
ahead of its appends (``fallocate``), because an fdatasync that must also record a grown
file costs more than one that does not. So the active segment may end in zero bytes past
its last frame, until the writer fills them, rolls to the next segment or stops (both cut
the room off). No frame has length 0, so where the bytes from a frame's start to the end
of the file are all zero, the log's data ends there: readers stop quietly, and a torn tail
is only what is left of a write that began.

One module per part: ``files`` (the FORMAT file, segment headers, kinds and names),
``frames`` (framing, the CRC and walking past bad bytes), ``messages``, ``actions``,
``index`` and ``schedule`` (the records of each log), ``ids`` (the id hash). Each imports
only the ones before it and ``qmq_broker.errors``: the package is shared by the broker and
by ``qmq_reconcile``, which ships it to Spark executors, and imports nothing of the server.

This ``__init__`` is the one place that re-exports what readers outside the broker read
(``qmq_reconcile``, and tests that read data directories): the FORMAT file, segments and
their frames, and the records the readers yield. The broker imports each name from its
module.
"""

from qmq_broker.format.actions import ActionRecord, ActionType, iter_action_records
from qmq_broker.format.files import (
    FORMAT_FILE,
    FORMAT_VERSION,
    HEADER_SIZE,
    SEGMENT_LAYOUT_FORMATS,
    SegmentKind,
    list_segments,
    read_format,
    read_segment,
    read_segment_header,
    segment_number,
)
from qmq_broker.format.frames import BadRegion, iter_frames, walk_frames
from qmq_broker.format.messages import (
    MessageRecord,
    iter_message_records,
    message_fields,
)
from qmq_broker.format.schedule import DispatchRecord, iter_dispatch_records
from qmq_wire.records import MessageFields

__all__ = [
    "FORMAT_FILE",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "SEGMENT_LAYOUT_FORMATS",
    "ActionRecord",
    "ActionType",
    "BadRegion",
    "DispatchRecord",
    "MessageFields",
    "MessageRecord",
    "SegmentKind",
    "iter_action_records",
    "iter_dispatch_records",
    "iter_frames",
    "iter_message_records",
    "list_segments",
    "message_fields",
    "read_format",
    "read_segment",
    "read_segment_header",
    "segment_number",
    "walk_frames",
]
