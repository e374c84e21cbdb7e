"""Rebuilding a route table from its declaration and the partitions' command messages.

Pure logic. Version 1 follows from the declaration; every later version is named by the
command messages of the partitions its change closed (each carries the change, the
partitions closed and the new ranges), and is replayed with ``Routes.split``, ``merge`` or
``move`` and checked against what the command says, so a rebuilt table holds the same
versions as the one written at the time. It cannot be done when a version has no command
left (retention removed the segment, or the record is unreadable) or a partition that holds
messages is named by no version: ``CannotRebuild`` says which.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import orjson

from qmq_broker.errors import StorageError
from qmq_broker.format.messages import MessageRecord
from qmq_broker.ordered.files import (
    Declaration,
    RouteFileDamaged,
    declaration_path,
    read_declaration,
)
from qmq_wire import RouteChange
from qmq_wire.ordered import COMMAND_HEADER, command_id, split_partition_log
from qmq_wire.routes import Range, RouteConflict, Routes


class CannotRebuild(StorageError):
    """A route table cannot be rebuilt: what is missing or contradicts itself."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """What one command message says: the change of ``version``, which closed ``partition``."""

    subject: str
    partition: int
    version: int
    change: RouteChange
    closed: tuple[int, ...]
    ranges: tuple[Range, ...]


def command_of(record: MessageRecord) -> Command | None:
    """The route change a stored record carries, if it is a command message."""
    subject, partition = split_partition_log(record.subject)
    if partition is None or record.headers.get(COMMAND_HEADER) != "route":
        return None
    try:
        body: Any = orjson.loads(record.body)
        version = int(body["version"])
        found = Command(
            subject=subject,
            partition=partition,
            version=version,
            change=body["change"],
            closed=tuple(int(p) for p in body["closed"]),
            ranges=tuple(
                Range(int(r["lo"]), int(r["hi"]), int(r["partition"])) for r in body["ranges"]
            ),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if record.id != command_id(version, partition) or partition not in found.closed:
        return None
    return found


def rebuild(declaration: Declaration, commands: Iterable[Command], stored: Iterable[int]) -> Routes:
    """The subject's routes from its declaration and its command messages; ``stored`` are
    the partitions that hold messages, each of which the result must name."""
    routes = declaration.routes()
    by_version: dict[int, Command] = {}
    for command in commands:
        seen = by_version.setdefault(command.version, command)
        if _said(seen) != _said(command):
            raise CannotRebuild(f"the command messages of route version {command.version} disagree")
    for version in range(2, max(by_version, default=1) + 1):
        found = by_version.get(version)
        if found is None:
            raise CannotRebuild(
                f"no command message of route version {version} is left (removed by "
                "retention, or unreadable)"
            )
        routes = _replayed(routes, found)
    unnamed = sorted(set(stored) - set(routes.every_partition()))
    if unnamed:
        raise CannotRebuild(
            f"partition(s) {', '.join(map(str, unnamed))} hold messages, but no command message "
            "left names the change that made them"
        )
    return routes


def rebuild_declared(
    data_dir: str | os.PathLike[str],
    subject: str,
    commands: Iterable[Command],
    stored: Iterable[int],
) -> Routes:
    """``rebuild`` from ``subject``'s declaration file; ``CannotRebuild`` when it does not
    read."""
    try:
        declaration = read_declaration(declaration_path(data_dir, subject))
    except RouteFileDamaged as exc:
        raise CannotRebuild(f"its declaration {exc.path} is {exc.what}") from None
    return rebuild(declaration, commands, stored)


def _said(command: Command) -> tuple[str, tuple[int, ...], tuple[Range, ...]]:
    return command.change, command.closed, command.ranges


def _replayed(routes: Routes, command: Command) -> Routes:
    """``routes`` with the change ``command`` names, if it is the change it made then."""
    try:
        if command.change == "split":
            first = routes.next_partition()
            at = next(r.hi for r in command.ranges if r.partition == first)
            changed = routes.split(command.closed[0], at)
        elif command.change == "merge":
            changed = routes.merge(command.closed)
        elif command.change == "move":
            changed = routes.move(command.closed[0])
        else:
            raise ValueError(command.change)
    except (RouteConflict, StopIteration, IndexError, ValueError):
        changed = routes
    current = changed.current
    if current.version != command.version or _said(command) != (
        current.change,
        current.closed,
        current.ranges,
    ):
        raise CannotRebuild(
            f"the command message of route version {command.version} does not follow from "
            f"version {command.version - 1}"
        )
    return changed
