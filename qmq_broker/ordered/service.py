"""Declaring ordered subjects and changing their routes (split, merge, move).

A change is written to its route file (durable) before anyone routes by it; then, with no
await in between, it is installed and its command messages are appended to the
partitions it closes, behind every message already placed there. A crash between the
file and the commands is finished on start (``restore_commands``): a closed partition
whose last record is not its command gets it then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable

import orjson

from qmq_broker.errors import Conflict, CorruptRecord, Invalid, NotFound, StorageError
from qmq_broker.lifecycle import Lifecycle
from qmq_broker.messages import IncomingMessage
from qmq_broker.ordered.files import save_routes
from qmq_broker.pulls.ordered import OrderedPulls
from qmq_broker.pulls.reads import read_message
from qmq_broker.routebook import RouteBook
from qmq_broker.storage.segments import SegmentReader
from qmq_broker.subjects import SubjectTable
from qmq_wire import OnDead, RoutesAnswerJson
from qmq_wire.ordered import (
    COMMAND_HEADER,
    COMMAND_PRODUCER,
    MAX_PARTITIONS,
    ROUTE_VERSION_HEADER,
    command_id,
    partition_log,
)
from qmq_wire.routes import RouteConflict, Routes, ranges_json

StoreCommands = Callable[
    [list[tuple[str, IncomingMessage]], Callable[[list[int]], None]], Awaitable[None]
]
"""Appends command messages to their partition logs (``ProduceService.store_commands``)."""


@dataclasses.dataclass(kw_only=True, eq=False)
class RouteService:
    """``PUT /v1/subjects/{subject}``, the partition changes and the routes document."""

    data_dir: str | os.PathLike[str]
    lifecycle: Lifecycle
    book: RouteBook
    subjects: SubjectTable
    store_commands: StoreCommands  # appends commands, answers once durable
    ordered: OrderedPulls
    reader: SegmentReader
    wake: Callable[[str], None]
    known_elsewhere: Callable[[str], bool]  # e.g. delayed messages of a plain subject
    _changing: dict[str, asyncio.Lock] = dataclasses.field(init=False, default_factory=dict)

    # --- operator calls ---------------------------------------------------------------------

    async def declare(self, subject: str, *, partitions: int, on_dead: OnDead) -> RoutesAnswerJson:
        """Make ``subject`` ordered; the same declaration again answers as the first did."""
        self.lifecycle.require()
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise Invalid(
                code="invalid_partitions",
                message=f"partitions must be 1..{MAX_PARTITIONS}",
                field="partitions",
            )
        async with self._lock(subject):
            found = self.book.get(subject)
            if found is not None:
                first = found.at(1)
                if len(first.partitions) != partitions or found.on_dead != on_dead:
                    raise Conflict(
                        code="subject_conflict",
                        message=(
                            f"{subject!r} is ordered with {len(first.partitions)} partitions "
                            f"and on_dead {found.on_dead!r}"
                        ),
                        field="partitions",
                    )
                return self.document(subject)
            if subject in self.subjects or self.known_elsewhere(subject):
                raise Conflict(
                    code="subject_conflict",
                    message=f"{subject!r} already holds or served messages unordered",
                    field="subject",
                )
            routes = Routes.create(subject, partitions=partitions, on_dead=on_dead)
            await self._save(routes)
            self.book.install(routes)
        return self.document(subject)

    async def split(self, subject: str, *, partition: int, at: int) -> RoutesAnswerJson:
        return await self._change(subject, lambda r: r.split(partition, at))

    async def merge(self, subject: str, *, partitions: list[int]) -> RoutesAnswerJson:
        return await self._change(subject, lambda r: r.merge(partitions))

    async def move(self, subject: str, *, partition: int) -> RoutesAnswerJson:
        return await self._change(subject, lambda r: r.move(partition))

    def document(self, subject: str) -> RoutesAnswerJson:
        """The routes document of an ordered subject (404/409 otherwise)."""
        self.lifecycle.require(write=False)
        routes = self._routes(subject)
        ordered = self.ordered
        groups = {g: ordered.group_version(subject, g) for g in ordered.groups_of(subject)}
        return routes.document(groups)

    # --- start ------------------------------------------------------------------------------

    async def restore_commands(self) -> int:
        """On start: note where each closed partition's command sits, and append the ones a
        crash kept from being stored. Returns how many were appended."""
        missing: list[tuple[str, IncomingMessage]] = []
        where: list[tuple[str, int]] = []
        for subject in self.book.subjects():
            routes = self._routes(subject)
            for partition, version in sorted(routes.closed().items()):
                seq = self._stored_command(subject, partition, version)
                if seq is not None:
                    self.book.commanded(subject, partition, seq)
                else:
                    missing.append(_command(routes, partition, version))
                    where.append((subject, partition))
        if missing:

            def placed(seqs: list[int]) -> None:
                for (subject, partition), seq in zip(where, seqs, strict=True):
                    self.book.commanded(subject, partition, seq)

            await self.store_commands(missing, placed)
        return len(missing)

    def _stored_command(self, subject: str, partition: int, version: int) -> int | None:
        """The seq of the partition's command if it is its last record (retention may have
        removed it after every group read it: then its last seq counts as the command)."""
        log = self.subjects.find(partition_log(subject, partition))
        if log is None or log.end_seq == 0:
            return None
        last = log.end_seq - 1
        if last < log.first_seq:
            return last
        try:
            record = read_message(self.reader, log, last)
        except (StorageError, CorruptRecord):
            return None  # unreadable: append the command again after it
        return last if record.id == command_id(version, partition) else None

    # --- changes ----------------------------------------------------------------------------

    async def _change(self, subject: str, make: Callable[[Routes], Routes]) -> RoutesAnswerJson:
        self.lifecycle.require()
        async with self._lock(subject):
            routes = self._routes(subject)
            try:
                changed = make(routes)
            except RouteConflict as exc:
                raise Conflict(
                    code="route_conflict", message=exc.message, field=exc.field
                ) from None
            await self._save(changed)
            # From here to the append, no await: nothing else reaches the closed partitions,
            # and the book knows each command's seq before a pull could see it.
            self.book.install(changed)
            version = changed.current
            commands = [_command(changed, p, version.version) for p in version.closed]

            def placed(seqs: list[int]) -> None:
                for partition, seq in zip(version.closed, seqs, strict=True):
                    self.book.commanded(subject, partition, seq)

            await self.store_commands(commands, placed)
            self.wake(subject)
        return self.document(subject)

    async def _save(self, routes: Routes) -> None:
        await asyncio.get_running_loop().run_in_executor(None, save_routes, self.data_dir, routes)

    def _lock(self, subject: str) -> asyncio.Lock:
        lock = self._changing.get(subject)
        if lock is None:
            lock = self._changing[subject] = asyncio.Lock()
        return lock

    def _routes(self, subject: str) -> Routes:
        routes = self.book.get(subject)
        if routes is not None:
            return routes
        if subject in self.subjects:
            raise Conflict(
                code="not_ordered", message=f"{subject!r} is not ordered", field="subject"
            )
        raise NotFound(code="subject_not_found", message=f"no subject {subject!r}", field="subject")


def _command(routes: Routes, partition: int, version: int) -> tuple[str, IncomingMessage]:
    change = routes.at(version)
    body = orjson.dumps(
        {
            "version": version,
            "change": change.change,
            "closed": list(change.closed),
            "ranges": ranges_json(change.ranges),
        }
    )
    message = IncomingMessage(
        id=command_id(version, partition),
        subject=routes.subject,
        key=None,
        headers={COMMAND_HEADER: "route", ROUTE_VERSION_HEADER: str(version)},
        body=body,
        body_base64=False,
        producer=COMMAND_PRODUCER,
        created_at_us=None,
        deliver_at_us=0,
    )
    return partition_log(routes.subject, partition), message
