"""checkpoint.json: log positions up to which indexes and group state are saved."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson

from broker.errors import StorageError
from broker.format import FORMAT_VERSION, HEADER_SIZE
from broker.storage.fsync import replace_file

CHECKPOINT_FILE = "checkpoint.json"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """Indexes are complete and group state is ``groups`` as of these log positions."""

    messages_at: tuple[int, int] = (0, HEADER_SIZE)
    actions_at: tuple[int, int] = (0, HEADER_SIZE)
    groups: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    written_at_us: int = 0

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "format": FORMAT_VERSION,
                "messages_at": list(self.messages_at),
                "actions_at": list(self.actions_at),
                "groups": self.groups,
                "written_at_us": self.written_at_us,
            }
        )

    @classmethod
    def load(cls, data_dir: Path) -> Checkpoint:
        path = data_dir / CHECKPOINT_FILE
        if not path.exists():
            return cls()
        try:
            doc = orjson.loads(path.read_bytes())
            if doc["format"] != FORMAT_VERSION:
                raise StorageError(f"{path}: unsupported format {doc['format']}")
            return cls(
                messages_at=(int(doc["messages_at"][0]), int(doc["messages_at"][1])),
                actions_at=(int(doc["actions_at"][0]), int(doc["actions_at"][1])),
                groups=dict(doc["groups"]),
                written_at_us=int(doc["written_at_us"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, IndexError, ValueError) as exc:
            raise StorageError(f"{path} is unreadable: {exc}") from exc

    def write(self, data_dir: Path) -> None:
        """Atomically replace the checkpoint (write, fsync, rename, fsync dir)."""
        replace_file(data_dir / CHECKPOINT_FILE, self.encode())
