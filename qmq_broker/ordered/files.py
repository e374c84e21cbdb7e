"""Route tables on disk: ``ordered/<subject>.json`` in the data directory, one per subject.

Written anew (atomically, fsynced) on every change; read once at start.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from qmq_broker.errors import StorageError
from qmq_broker.storage.fsync import replace_file, sync_dir
from qmq_wire.routes import Routes

ROUTES_DIR = "ordered"


def load_routes(data_dir: str | os.PathLike[str]) -> dict[str, Routes]:
    """Every ordered subject's routes; a file that breaks a rule stops the broker."""
    folder = Path(data_dir) / ROUTES_DIR
    found: dict[str, Routes] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.json")):
        try:
            routes = Routes.from_doc(orjson.loads(path.read_bytes()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StorageError(f"{path}: unreadable route table: {exc}") from exc
        if routes.subject + ".json" != path.name:
            raise StorageError(f"{path}: holds the routes of {routes.subject!r}")
        found[routes.subject] = routes
    return found


def save_routes(data_dir: str | os.PathLike[str], routes: Routes) -> None:
    """Write one subject's routes durably (blocking: run it off the event loop)."""
    folder = Path(data_dir) / ROUTES_DIR
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        sync_dir(folder.parent)
    replace_file(folder / f"{routes.subject}.json", orjson.dumps(routes.to_doc()))
