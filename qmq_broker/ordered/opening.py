"""Reading the route tables at start, after recovery: damaged ones rebuilt or refused.

A table that does not check out stops the broker with one line naming the file, what is
wrong and the command that fixes it, unless ``on_damage`` is ``"skip"``: then it is rebuilt
from its declaration and the partitions' last records (a closed partition's last record is
its command message), or, when that cannot be done, its subject alone is fenced. Bare
format-1 tables are rewritten sealed, and a missing or damaged declaration is written
anew from a table that reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from qmq_broker.errors import CorruptRecord, StorageError
from qmq_broker.ordered.files import (
    ROUTES_DIR,
    Declaration,
    RouteFileDamaged,
    declaration_path,
    declaration_problem,
    read_route_files,
    save_declaration,
    save_routes,
)
from qmq_broker.ordered.rebuild import CannotRebuild, Command, command_of, rebuild_declared
from qmq_broker.pulls.reads import read_message
from qmq_broker.routebook import Fence
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectTable
from qmq_wire.ordered import split_partition_log
from qmq_wire.routes import Routes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OpenedRoutes:
    """The routes to serve, the subjects fenced (with why) and what was noted on the way."""

    routes: dict[str, Routes]
    fenced: dict[str, Fence]
    problems: list[str]


def open_routes(
    data_dir: str | os.PathLike[str],
    *,
    subjects: SubjectTable,
    reader: SegmentReader,
    on_damage: str,
) -> OpenedRoutes:
    """Every ordered subject's routes; ``StorageError`` for a damaged table unless skipping."""
    files = read_route_files(data_dir)
    rebuilt: dict[str, Routes] = {}
    unbuildable: dict[str, CannotRebuild] = {}
    for subject in files.damaged:
        try:
            rebuilt[subject] = rebuild_at_start(data_dir, subject, subjects, reader)
        except CannotRebuild as exc:
            unbuildable[subject] = exc
    if files.damaged and on_damage != "skip":
        raise StorageError(_refusal(data_dir, files.damaged, unbuildable))
    problems: list[str] = []
    routes = {subject: found.routes for subject, found in files.good.items()}
    for found in files.good.values():
        problems += _kept_current(data_dir, found.routes, sealed=found.sealed)
    for subject, table in rebuilt.items():
        save_routes(data_dir, table)
        routes[subject] = table
        damage = files.damaged[subject]
        problems.append(
            f"{damage}; rebuilt from its declaration and the partitions' command messages "
            f"(route version {table.current.version})"
        )
    fenced = {}
    for subject, why in unbuildable.items():
        damage = files.damaged[subject]
        fenced[subject] = _fence(subject, damage.path, why, subjects, reader)
        problems.append(f"{damage}; cannot be rebuilt ({why}): {subject!r} fenced")
    for problem in problems:
        logger.warning(problem, extra={"action": "broker.recovery_problem"})
    return OpenedRoutes(routes=routes, fenced=fenced, problems=problems)


def rebuild_at_start(
    data_dir: str | os.PathLike[str], subject: str, subjects: SubjectTable, reader: SegmentReader
) -> Routes:
    """``subject``'s routes from its declaration and its partitions' last records."""
    commands, stored = partition_tails(subject, subjects, reader)
    return rebuild_declared(data_dir, subject, (c for _, c in commands.values()), stored)


def partition_tails(
    subject: str, subjects: SubjectTable, reader: SegmentReader
) -> tuple[dict[int, tuple[int, Command]], set[int]]:
    """The commands among ``subject``'s partitions' last records (partition -> seq and
    command), and the partitions that hold messages."""
    commands: dict[int, tuple[int, Command]] = {}
    stored: set[int] = set()
    for name in subjects:
        owner, partition = split_partition_log(name)
        log = subjects[name]
        if owner != subject or partition is None or log.end_seq == 0:
            continue
        stored.add(partition)
        if log.end_seq - 1 < log.first_seq:
            continue  # removed by retention
        try:
            record = read_message(reader, log, log.end_seq - 1)
        except (StorageError, CorruptRecord):
            continue
        command = command_of(record)
        if command is not None:
            commands[partition] = (log.end_seq - 1, command)
    return commands, stored


def _fence(
    subject: str, path: Path, why: CannotRebuild, subjects: SubjectTable, reader: SegmentReader
) -> Fence:
    """What the book needs to keep ``subject`` read-only: the error its calls answer, its
    partitions on disk and its commands' seqs (not counted as messages)."""
    found = (split_partition_log(name) for name in subjects)
    commands, _ = partition_tails(subject, subjects, reader)
    return Fence(
        why=f"{subject!r} is fenced: its route table {Path(ROUTES_DIR, path.name)} does not "
        f"check out and cannot be rebuilt ({why}); restore that file from a backup and "
        "restart the broker",
        partitions=tuple(sorted(p for owner, p in found if owner == subject and p is not None)),
        commands={partition: seq for partition, (seq, _) in commands.items()},
    )


def _kept_current(data_dir: str | os.PathLike[str], routes: Routes, *, sealed: bool) -> list[str]:
    """Rewrite a bare table sealed, and a missing or damaged declaration from the table;
    the damage noted."""
    noted = []
    if not sealed:
        save_routes(data_dir, routes)  # writes a missing declaration too
        logger.info(
            "route table rewritten with a CRC-32 (format 2)",
            extra={"action": "broker.routes_sealed", "subject": routes.subject},
        )
    why = declaration_problem(data_dir, routes)
    if why is not None:
        save_declaration(data_dir, Declaration.of(routes))
        if why != "missing":
            noted.append(f"{declaration_path(data_dir, routes.subject)}: {why}; written anew")
    return noted


def _refusal(
    data_dir: str | os.PathLike[str],
    damaged: dict[str, RouteFileDamaged],
    unbuildable: dict[str, CannotRebuild],
) -> str:
    """One line: the first damaged table, what is wrong, and the command that fixes it."""
    subject, damage = next(iter(damaged.items()))
    more = f" (and {len(damaged) - 1} more route tables)" if len(damaged) > 1 else ""
    if subject in unbuildable:
        fix = (
            f"it cannot be rebuilt ({unbuildable[subject]}): restore it from a backup, or "
            f"start with --on-damage skip to serve the rest with {subject!r} fenced"
        )
    else:
        fix = (
            f"run `qmq broker verify --data-dir {data_dir} --repair` to rebuild it from its "
            "declaration and the partitions' command messages, or start with --on-damage skip"
        )
    return f"{damage.path}: route table does not check out ({damage.what}){more}; {fix}"
