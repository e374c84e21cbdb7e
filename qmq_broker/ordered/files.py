"""Route tables and declarations on disk, each sealed with a CRC-32.

``ordered/<subject>.json`` holds the subject's route table, written anew (atomically,
fsynced) on every change: ``{"format": 2, "crc32": C, "table": T}``, ``T`` the table
(``Routes.to_doc``, its own format 1) and ``C`` the CRC-32 of ``T``'s bytes as written.
A bare format-1 table (data directories from before the seal) is still read; the broker
rewrites it sealed at its next start. ``ordered/declared/<subject>.json`` holds what the
subject was declared with (``{"format": 1, "crc32": C, "declaration": D}``), written once:
with the partitions' command messages it is what a damaged table is rebuilt from.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path
from typing import Any

import orjson

from qmq_broker.errors import StorageError
from qmq_broker.storage.fsync import replace_file, sync_dir
from qmq_wire import OnDead
from qmq_wire.ordered import MAX_PARTITIONS, ON_DEAD
from qmq_wire.routes import ROUTES_FORMAT, Routes

ROUTES_DIR = "ordered"
DECLARED_DIR = "declared"
TABLE_FORMAT = 2  # a sealed table; format 1 (ROUTES_FORMAT) is the bare table inside
DECLARATION_FORMAT = 1


class RouteFileDamaged(StorageError):
    """A route table or declaration file that does not check out."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path = path
        self.what = what


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Declaration:
    """What an ordered subject was declared with: its route version 1, and ``on_dead``."""

    subject: str
    partitions: int
    on_dead: OnDead

    @classmethod
    def of(cls, routes: Routes) -> Declaration:
        return cls(
            subject=routes.subject, partitions=len(routes.at(1).ranges), on_dead=routes.on_dead
        )

    def routes(self) -> Routes:
        return Routes.create(self.subject, partitions=self.partitions, on_dead=self.on_dead)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TableFile:
    """A route table read from disk; ``sealed`` is False for a bare format-1 table."""

    routes: Routes
    sealed: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RouteFiles:
    """Every route table of a data directory: those that read, those that do not."""

    good: dict[str, TableFile]
    damaged: dict[str, RouteFileDamaged]


def routes_dir(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / ROUTES_DIR


def table_path(data_dir: str | os.PathLike[str], subject: str) -> Path:
    return routes_dir(data_dir) / f"{subject}.json"


def declaration_path(data_dir: str | os.PathLike[str], subject: str) -> Path:
    return routes_dir(data_dir) / DECLARED_DIR / f"{subject}.json"


# --- the seal ----------------------------------------------------------------------------


def seal(fmt: int, key: str, content: Any) -> bytes:
    """``content`` as JSON under ``key``, beside its format and the CRC-32 of its bytes."""
    body = orjson.dumps(content)
    return b'{"format":%d,"crc32":%d,"%s":%s}\n' % (fmt, zlib.crc32(body), key.encode(), body)


def unseal(raw: bytes, path: Path, *, fmt: int, key: str) -> Any:
    """The content ``seal`` wrote, once its CRC-32 checks out; ``RouteFileDamaged`` if not."""
    outer = _json(raw, path)
    if not isinstance(outer, dict) or outer.get("format") != fmt:
        found = outer.get("format") if isinstance(outer, dict) else None
        raise RouteFileDamaged(path, f"unknown format {found!r} (expected {fmt})")
    crc = outer.get("crc32")
    marker = b',"%s":' % key.encode()
    start, end = raw.find(marker), raw.rstrip().rfind(b"}")
    if not isinstance(crc, int) or key not in outer or start < 0:
        raise RouteFileDamaged(path, f"no crc32 or {key} field")
    actual = zlib.crc32(raw[start + len(marker) : end])
    if actual != crc:
        raise RouteFileDamaged(path, f"CRC-32 mismatch (the file says {crc}, its {key} {actual})")
    return outer[key]


def _json(raw: bytes, path: Path) -> Any:
    if not raw:
        raise RouteFileDamaged(path, "empty")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RouteFileDamaged(path, f"not JSON, cut short or garbled ({exc})") from None


# --- reading -----------------------------------------------------------------------------


def read_table(path: Path) -> TableFile:
    """One route table, sealed or bare, checked against every routing rule."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RouteFileDamaged(path, f"unreadable ({exc.strerror})") from exc
    outer = _json(raw, path)
    sealed = not (isinstance(outer, dict) and outer.get("format") == ROUTES_FORMAT)
    doc = unseal(raw, path, fmt=TABLE_FORMAT, key="table") if sealed else outer
    try:
        routes = Routes.from_doc(doc)
    except (ValueError, KeyError, TypeError) as exc:
        raise RouteFileDamaged(path, f"breaks a routing rule ({exc})") from None
    if routes.subject + ".json" != path.name:
        raise RouteFileDamaged(path, f"holds the routes of {routes.subject!r}")
    return TableFile(routes=routes, sealed=sealed)


def read_declaration(path: Path) -> Declaration:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RouteFileDamaged(path, "missing") from None
    except OSError as exc:
        raise RouteFileDamaged(path, f"unreadable ({exc.strerror})") from exc
    doc = unseal(raw, path, fmt=DECLARATION_FORMAT, key="declaration")
    try:
        found = Declaration(
            subject=str(doc["subject"]), partitions=int(doc["partitions"]), on_dead=doc["on_dead"]
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RouteFileDamaged(path, f"not a declaration ({exc})") from None
    if found.on_dead not in ON_DEAD or not 1 <= found.partitions <= MAX_PARTITIONS:
        raise RouteFileDamaged(path, "not a declaration (a value out of range)")
    if found.subject + ".json" != path.name:
        raise RouteFileDamaged(path, f"holds the declaration of {found.subject!r}")
    return found


MISMATCH = "does not match its route table"


def declaration_problem(data_dir: str | os.PathLike[str], routes: Routes) -> str | None:
    """Why the declaration file of ``routes``' subject is not the one the table implies
    (``"missing"``, its damage, or ``MISMATCH``); None when it is."""
    try:
        found = read_declaration(declaration_path(data_dir, routes.subject))
    except RouteFileDamaged as exc:
        return exc.what
    return None if found == Declaration.of(routes) else MISMATCH


def read_route_files(data_dir: str | os.PathLike[str]) -> RouteFiles:
    """Every route table in ``data_dir``, sorted into those that read and those that do not."""
    folder = routes_dir(data_dir)
    good: dict[str, TableFile] = {}
    damaged: dict[str, RouteFileDamaged] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        subject = path.name.removesuffix(".json")
        try:
            good[subject] = read_table(path)
        except RouteFileDamaged as exc:
            damaged[subject] = exc
    return RouteFiles(good=good, damaged=damaged)


# --- writing -----------------------------------------------------------------------------


def save_routes(data_dir: str | os.PathLike[str], routes: Routes) -> None:
    """Write one subject's routes durably, sealed (blocking: run it off the event loop).

    A declaration (version 1) writes the declaration file first; a later change writes it
    only when it is missing (a data directory from before declarations were kept).
    """
    folder = routes_dir(data_dir)
    if not (folder / DECLARED_DIR).is_dir():
        (folder / DECLARED_DIR).mkdir(parents=True, exist_ok=True)
        sync_dir(folder)
        sync_dir(folder.parent)
    if routes.current.version == 1 or not declaration_path(data_dir, routes.subject).exists():
        save_declaration(data_dir, Declaration.of(routes))
    replace_file(table_path(data_dir, routes.subject), seal(TABLE_FORMAT, "table", routes.to_doc()))


def save_declaration(data_dir: str | os.PathLike[str], declaration: Declaration) -> None:
    content = {
        "subject": declaration.subject,
        "partitions": declaration.partitions,
        "on_dead": declaration.on_dead,
    }
    path = declaration_path(data_dir, declaration.subject)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, seal(DECLARATION_FORMAT, "declaration", content))
