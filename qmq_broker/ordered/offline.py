"""Route tables in a stopped broker's data directory: what ``verify`` reports, what
``verify --repair`` rewrites.

A damaged table is rebuilt from its declaration and every command message found in the
message log (read whole: an index may lag the log after a crash); a damaged declaration
is written anew from a table that reads. Bare format-1 tables are not damage: the broker
rewrites them sealed at start.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

from qmq_broker.format.files import SegmentKind, list_segments
from qmq_broker.format.index import index_chunk_path, list_index_chunks, list_indexed_subjects
from qmq_broker.format.messages import MessageRecord, peek_message
from qmq_broker.ordered.files import (
    MISMATCH,
    Declaration,
    declaration_path,
    declaration_problem,
    read_route_files,
    save_declaration,
    save_routes,
)
from qmq_broker.ordered.rebuild import CannotRebuild, Command, command_of, rebuild_declared
from qmq_broker.storage.index_files import read_chunk
from qmq_broker.storage.segments import message_frames
from qmq_wire.ordered import split_partition_log
from qmq_wire.routes import Routes

COMMAND_ID_PREFIX = "_qmq.route."  # of every id qmq_wire.ordered.command_id makes
REPAIRABLE = "--repair rebuilds it from its declaration and the partitions' command messages"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RouteDamage:
    """One damaged route file, what it costs, and whether ``--repair`` rewrites it."""

    path: Path
    damage: str
    cost: str
    repairable: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    damage: list[RouteDamage]
    tables: dict[Path, Routes]  # rebuilt, to write
    declarations: dict[Path, Declaration]  # from good tables, to write


def inspect_route_files(data_dir: Path) -> list[RouteDamage]:
    """Every route table and declaration that does not check out (reads only)."""
    return _plan(data_dir).damage


def repair_route_files(data_dir: Path) -> list[str]:
    """Rewrite what can be: rebuilt tables, declarations from their tables."""
    plan = _plan(data_dir)
    done = []
    for path, routes in plan.tables.items():
        save_routes(data_dir, routes)
        done.append(
            f"rewrote {path} (rebuilt from its declaration and the partitions' command "
            f"messages: route version {routes.current.version})"
        )
    for path, declaration in plan.declarations.items():
        save_declaration(data_dir, declaration)
        done.append(f"rewrote {path} from its route table")
    return done


def _plan(data_dir: Path) -> _Plan:
    files = read_route_files(data_dir)
    plan = _Plan(damage=[], tables={}, declarations={})
    for subject, table in files.good.items():
        why = declaration_problem(data_dir, table.routes)
        if why is None or why == "missing":
            continue  # missing: a data directory from before declarations; the broker writes it
        path = declaration_path(data_dir, subject)
        what = why if why == MISMATCH else f"declaration does not check out ({why})"
        cost = "derived file: --repair (or the broker at start) writes it anew from the table"
        plan.damage.append(RouteDamage(path=path, damage=what, cost=cost, repairable=True))
        plan.declarations[path] = Declaration.of(table.routes)
    if not files.damaged:
        return plan
    found = scan_commands(data_dir, set(files.damaged))
    for subject, damage in files.damaged.items():
        what = f"route table does not check out ({damage.what})"
        try:
            commands, stored = found.get(subject, ([], set()))
            plan.tables[damage.path] = rebuild_declared(data_dir, subject, commands, stored)
        except CannotRebuild as exc:
            cost = (
                f"cannot be rebuilt ({exc}): restore it from a backup; meanwhile the broker "
                f"starts only with --on-damage skip, with {subject!r} fenced"
            )
            plan.damage.append(
                RouteDamage(path=damage.path, damage=what, cost=cost, repairable=False)
            )
            continue
        cost = f"the broker starts only with --on-damage skip (which rebuilds it); {REPAIRABLE}"
        plan.damage.append(RouteDamage(path=damage.path, damage=what, cost=cost, repairable=True))
    return plan


def scan_commands(data_dir: Path, subjects: set[str]) -> dict[str, tuple[list[Command], set[int]]]:
    """Per subject of ``subjects``: every command message in the message log, and the
    partitions that hold messages (in the log or in their index)."""
    found: dict[str, tuple[list[Command], set[int]]] = defaultdict(lambda: ([], set()))
    for name in list_indexed_subjects(data_dir):
        subject, partition = split_partition_log(name)
        if subject in subjects and partition is not None and _indexed(data_dir, name):
            found[subject][1].add(partition)
    for path in list_segments(data_dir, SegmentKind.MESSAGES):
        for offset, payload in message_frames(path):
            _, _, log, message_id = peek_message(payload)
            subject, partition = split_partition_log(log)
            if subject not in subjects or partition is None:
                continue
            found[subject][1].add(partition)
            if message_id.startswith(COMMAND_ID_PREFIX):
                record = MessageRecord.decode(payload, path=str(path), offset=offset)
                command = command_of(record)
                if command is not None:
                    found[subject][0].append(command)
    return dict(found)


def _indexed(data_dir: Path, log: str) -> bool:
    """Whether a partition's index names at least one seq."""
    for start in list_index_chunks(data_dir, log)[-1:]:
        chunk = read_chunk(index_chunk_path(data_dir, log, start))
        return start > 0 or (chunk is not None and len(chunk.entries) > 0)
    return False
