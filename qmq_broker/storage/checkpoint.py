"""checkpoint.json: log positions up to which indexes and group state are saved.

Kept in pairs, each with a CRC: writing a checkpoint moves the current one to
``checkpoint.prev.json`` and puts the new one in its place (both renames atomic). Loading
takes the newest one whose CRC and fields check out; when neither does, recovery starts
from nothing and rebuilds from the logs (what a lost checkpoint costs: a longer scan, and
for groups whose early action segments retention already removed, redeliveries). File
layout: ``{"crc32": <crc of the body>, "checkpoint": <body>}``, the body serialised with
sorted keys so its bytes, and so its CRC, are canonical. Checkpoints of older formats
(format 1 with or without a CRC, format 2) are rewritten in the current one when the data
directory is migrated on start (``qmq_broker.recovery.migrate``).
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import Any

import orjson

from qmq_broker.errors import StorageError
from qmq_broker.format.files import FORMAT_VERSION, HEADER_SIZE
from qmq_broker.storage.fsync import replace_keeping_previous

CHECKPOINT_FILE = "checkpoint.json"
PREVIOUS_FILE = "checkpoint.prev.json"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IndexDigest:
    """A subject's index as a checkpoint saw it.

    ``count`` entries; ``crc`` the CRC-32 of the entries ``[chunk_start(count), count)``
    (those of the newest, unsealed chunk: sealed chunks carry their own CRC); the first
    retained seq and the stored bytes of the retained messages then, so recovery does not
    add up the whole index. ``first_seq`` and ``bytes`` are -1 when not known (a checkpoint
    migrated from format 1).
    """

    count: int
    crc: int
    first_seq: int = -1
    bytes: int = -1

    def encode(self) -> list[int]:
        return [self.count, self.crc, self.first_seq, self.bytes]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """Indexes are complete and group state is ``groups`` as of these log positions."""

    messages_at: tuple[int, int] = (0, HEADER_SIZE)
    actions_at: tuple[int, int] = (0, HEADER_SIZE)
    groups: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    written_at_us: int = 0
    indexes: dict[str, IndexDigest] = dataclasses.field(default_factory=dict)

    def encode(self) -> bytes:
        body = orjson.dumps(
            {
                "format": FORMAT_VERSION,
                "messages_at": list(self.messages_at),
                "actions_at": list(self.actions_at),
                "groups": self.groups,
                "written_at_us": self.written_at_us,
                "indexes": {name: digest.encode() for name, digest in self.indexes.items()},
            },
            option=orjson.OPT_SORT_KEYS,
        )
        return b'{"crc32":%d,"checkpoint":%s}' % (zlib.crc32(body), body)

    @classmethod
    def decode(cls, data: bytes, *, path: str) -> Checkpoint:
        """A checkpoint from its file's bytes; ``StorageError`` when they do not check out."""
        try:
            doc = orjson.loads(data)
            if "crc32" in doc:
                body = orjson.dumps(doc["checkpoint"], option=orjson.OPT_SORT_KEYS)
                if zlib.crc32(body) != int(doc["crc32"]):
                    raise ValueError("CRC mismatch")
                doc = doc["checkpoint"]
            if doc["format"] != FORMAT_VERSION:
                raise ValueError(f"unsupported format {doc['format']}")
            digests = doc.get("indexes", {})
            checkpoint = cls(
                messages_at=(int(doc["messages_at"][0]), int(doc["messages_at"][1])),
                actions_at=(int(doc["actions_at"][0]), int(doc["actions_at"][1])),
                groups=dict(doc["groups"]),
                written_at_us=int(doc["written_at_us"]),
                indexes={
                    str(name): IndexDigest(
                        count=int(d[0]), crc=int(d[1]), first_seq=int(d[2]), bytes=int(d[3])
                    )
                    for name, d in digests.items()
                },
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, IndexError, ValueError) as exc:
            raise StorageError(f"{path} is unreadable: {exc}") from exc
        if min(*checkpoint.messages_at, *checkpoint.actions_at) < 0:
            raise StorageError(f"{path} is unreadable: a negative log position")
        return checkpoint

    @classmethod
    def load(cls, data_dir: Path, problems: list[str] | None = None) -> Checkpoint:
        """The newest checkpoint that checks out, or an empty one (rebuild from the logs).

        What was wrong with the files passed over is appended to ``problems``.
        """
        passed_over: list[str] = []
        checkpoint = cls()
        for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
            path = data_dir / name
            if not path.exists():
                continue
            try:
                checkpoint = cls.decode(path.read_bytes(), path=str(path))
                break
            except StorageError as exc:
                passed_over.append(f"{exc}; passed over")
        else:
            if passed_over:
                passed_over.append(f"{data_dir}: no checkpoint checks out; rebuilt from the logs")
        if problems is not None:
            problems.extend(passed_over)
        return checkpoint

    @classmethod
    def oldest_actions_segment(cls, data_dir: Path) -> int:
        """The lowest action segment either kept checkpoint replays from (keep it and later)."""
        segments = []
        for name in (CHECKPOINT_FILE, PREVIOUS_FILE):
            path = data_dir / name
            if path.exists():
                try:
                    segments.append(cls.decode(path.read_bytes(), path=str(path)).actions_at[0])
                except StorageError:
                    return 0
        return min(segments, default=0)

    def write(self, data_dir: Path) -> None:
        """Replace the checkpoint atomically, keeping the one it replaces as the previous."""
        replace_keeping_previous(
            data_dir / CHECKPOINT_FILE, data_dir / PREVIOUS_FILE, self.encode()
        )
