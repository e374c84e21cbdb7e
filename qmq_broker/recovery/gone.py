"""Seqs whose record is gone from the log: they stay allocated, and their index entries
(marks) read as unreadable, so a seq is never handed out again once any durable evidence
shows it (``qmq_broker.recovery.recover`` step 2)."""

from __future__ import annotations

from pathlib import Path

from qmq_broker.format.files import segment_number
from qmq_broker.format.frames import FRAME_SIZE
from qmq_broker.format.index import INDEX_ENTRY
from qmq_broker.groups import GroupTable
from qmq_broker.recovery.index import WorkingIndex
from qmq_broker.storage.checkpoint import IndexDigest


def mark(segment: int, stored_us: int = 0) -> bytes:
    """An entry for a seq whose record is gone: it points at a segment header, where no
    frame can be, so it reads as unreadable; the seq stays allocated."""
    return INDEX_ENTRY.pack(segment, FRAME_SIZE, 0, stored_us, 0)


def is_mark(entry: tuple[int, int, int, int, int]) -> bool:
    return entry[2] == 0 and entry[1] == FRAME_SIZE


Gone = dict[str, set[int]]  # per subject: seqs recovery marked because their record is gone


def mark_records_gone(
    indexes: dict[str, WorkingIndex], segments: list[Path], valid_ends: dict[int, int]
) -> Gone:
    """Entries whose record lies past the valid data of a scanned segment, or in a segment
    past the newest, keep their seqs and are marked (``mark``).

    An index entry is written only after its record was, so an entry without its record
    means the log lost bytes it had held: below acknowledged data, never a torn tail. (After
    a power cut during a batch's fsync its producer may have had no answer; it resends, and
    the message is stored again under a new seq.) ``_index_tail`` then corrects the entries
    whose record it finds elsewhere in the log.
    """
    last_segment = segment_number(segments[-1]) if segments else -1
    gone: Gone = {}
    for name, index in indexes.items():
        seqs = []
        for seq, entry in index.entries_between(index.base, index.count):
            segment, length, offset, _, _ = entry
            end = valid_ends.get(segment)
            past = segment > last_segment or (end is not None and offset + length > end)
            if past and not is_mark(entry):
                seqs.append(seq)
        for seq in seqs:
            segment, _, _, stored, _ = index.entry(seq)
            index.set(seq, mark(segment, stored))
        if seqs:
            gone[name] = set(seqs)
    return gone


def keep_checkpointed_seqs(
    indexes: dict[str, WorkingIndex],
    digests: dict[str, IndexDigest],
    segment: int,
    rebuild: set[str],
    gone: Gone,
) -> None:
    """A rebuilt index keeps every seq the checkpoint covered, found in the log or not:
    those were acknowledged, so they are never handed out again (unreadable if gone)."""
    for name in rebuild:
        _keep_below(indexes[name], digests[name].count if name in digests else 0, segment, gone)


def keep_seqs_groups_saw(
    indexes: dict[str, WorkingIndex],
    groups: GroupTable,
    segment: int,
    gone: Gone,
    data_dir: Path,
) -> None:
    """Seqs a group already read must never be handed out again, even when the log lost them
    (a tail cut past the checkpoint): they stay allocated and read as unreadable (their
    entries point at a segment header, where no frame can be)."""
    seen: dict[str, int] = {}
    for (subject, _), group in groups.items():
        for state in group.states.values():
            top = max((state.cursor - 1, *state.leases, *state.retries, *state.dead))
            seen[subject] = max(seen.get(subject, -1), top)
    for subject, top in seen.items():
        index = indexes.get(subject)
        if index is None:
            index = indexes[subject] = WorkingIndex(data_dir=data_dir, name=subject)
        _keep_below(index, top + 1, segment, gone)


def _keep_below(index: WorkingIndex, end: int, segment: int, gone: Gone) -> None:
    """Seqs below ``end`` that the index lacks stay allocated, marked as gone."""
    count = index.count
    if count < end:
        gone.setdefault(index.name, set()).update(range(count, end))
        index.entries += mark(segment) * (end - count)


def still_gone(index: WorkingIndex, seqs: set[int]) -> list[int]:
    """The seqs of ``seqs`` whose entry is still a mark (a record found in the log replaced
    the others), sorted."""
    return sorted(seq for seq in seqs if seq < index.count and is_mark(index.entry(seq)))
