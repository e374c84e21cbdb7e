"""Route tables on disk: sealed with a CRC-32, every single-bit flip and every cut caught,
bare format-1 tables still read; and rebuilt from the declaration and command messages."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from qmq_broker.errors import Unavailable
from qmq_broker.format import MessageRecord
from qmq_broker.ordered.files import (
    Declaration,
    RouteFileDamaged,
    declaration_path,
    read_declaration,
    read_route_files,
    read_table,
    save_routes,
    table_path,
)
from qmq_broker.ordered.rebuild import CannotRebuild, Command, command_of, rebuild
from qmq_broker.ordered.service import _command
from qmq_broker.routebook import Fence, RouteBook
from qmq_wire.ordered import partition_log
from qmq_wire.routes import Routes

SUBJECT = "orders.changed"


def changed_routes() -> Routes:
    """Declared with 2 partitions, then a split, a merge of its halves and a move."""
    routes = Routes.create(SUBJECT, partitions=2, on_dead="block")
    routes = routes.split(0, 256)  # v2: 0 -> 2, 3
    routes = routes.merge([2, 3])  # v3: 2, 3 -> 4
    return routes.move(1)  # v4: 1 -> 5


def record_of(routes: Routes, partition: int, version: int, seq: int = 7) -> MessageRecord:
    log, message = _command(routes, partition, version)
    assert log == partition_log(SUBJECT, partition)
    return MessageRecord(
        seq=seq,
        id=message.id,
        subject=log,
        key=None,
        headers=message.headers,
        body=message.body,
        body_base64=False,
        producer=message.producer,
        created_at_us=1,
        stored_at_us=1,
        deliver_at_us=0,
    )


def commands_of(routes: Routes) -> list[Command]:
    found = []
    for partition, version in routes.closed().items():
        command = command_of(record_of(routes, partition, version))
        assert command is not None
        found.append(command)
    return found


# --- the seal ------------------------------------------------------------------------------


def test_a_saved_table_reads_back_sealed_with_its_declaration(tmp_path: Path) -> None:
    routes = changed_routes()
    save_routes(tmp_path, routes)
    assert orjson.loads(table_path(tmp_path, SUBJECT).read_bytes())["format"] == 2
    found = read_table(table_path(tmp_path, SUBJECT))
    assert found.sealed
    assert found.routes == routes
    declared = read_declaration(declaration_path(tmp_path, SUBJECT))
    assert declared == Declaration(subject=SUBJECT, partitions=2, on_dead="block")


def test_every_single_bit_flip_and_every_cut_is_caught(tmp_path: Path) -> None:
    save_routes(tmp_path, changed_routes())
    for path in (table_path(tmp_path, SUBJECT), declaration_path(tmp_path, SUBJECT)):
        original = path.read_bytes()
        read = read_table if path.parent.name == "ordered" else read_declaration
        for at in range(len(original)):
            for bit in range(8):
                flipped = bytearray(original)
                flipped[at] ^= 1 << bit
                path.write_bytes(bytes(flipped))
                with pytest.raises(RouteFileDamaged):
                    read(path)
        for size in range(len(original.rstrip())):
            path.write_bytes(original[:size])
            with pytest.raises(RouteFileDamaged):
                read(path)
        path.write_bytes(original)


def test_a_bare_format_1_table_still_reads(tmp_path: Path) -> None:
    routes = changed_routes()
    path = table_path(tmp_path, SUBJECT)
    path.parent.mkdir(parents=True)
    path.write_bytes(orjson.dumps(routes.to_doc()))
    found = read_table(path)
    assert found.routes == routes
    assert not found.sealed


def test_damaged_tables_are_sorted_out_from_those_that_read(tmp_path: Path) -> None:
    save_routes(tmp_path, changed_routes())
    save_routes(tmp_path, Routes.create("other", partitions=1, on_dead="skip"))
    path = table_path(tmp_path, "other")
    path.write_bytes(path.read_bytes()[:20])
    files = read_route_files(tmp_path)
    assert list(files.good) == [SUBJECT]
    assert list(files.damaged) == ["other"]
    assert files.damaged["other"].path == path


def test_a_table_under_another_subjects_name_is_damage(tmp_path: Path) -> None:
    save_routes(tmp_path, changed_routes())
    moved = table_path(tmp_path, "elsewhere")
    table_path(tmp_path, SUBJECT).rename(moved)
    with pytest.raises(RouteFileDamaged, match=r"holds the routes of 'orders\.changed'"):
        read_table(moved)


# --- the rebuild ----------------------------------------------------------------------------


def test_a_rebuilt_table_equals_the_original() -> None:
    routes = changed_routes()
    declared = Declaration.of(routes)
    assert rebuild(declared, commands_of(routes), routes.every_partition()) == routes
    assert rebuild(declared, [], [0, 1]) == Routes.create(SUBJECT, partitions=2, on_dead="block")


def test_a_version_whose_command_is_gone_cannot_be_rebuilt() -> None:
    routes = changed_routes()
    left = [c for c in commands_of(routes) if c.version != 3]
    with pytest.raises(CannotRebuild, match="route version 3"):
        rebuild(Declaration.of(routes), left, [])


def test_one_command_of_a_merge_is_enough() -> None:
    routes = changed_routes()
    left = [c for c in commands_of(routes) if c.partition != 2]
    assert rebuild(Declaration.of(routes), left, []) == routes


def test_a_partition_holding_messages_that_no_version_names_cannot_be_rebuilt() -> None:
    routes = changed_routes()
    newest_gone = [c for c in commands_of(routes) if c.version != 4]
    with pytest.raises(CannotRebuild, match=r"partition\(s\) 5 hold messages"):
        rebuild(Declaration.of(routes), newest_gone, routes.every_partition())


def test_a_command_that_does_not_follow_from_the_declaration_cannot_be_rebuilt() -> None:
    routes = changed_routes()
    other = Declaration(subject=SUBJECT, partitions=3, on_dead="block")
    with pytest.raises(CannotRebuild, match="does not follow from version 1"):
        rebuild(other, commands_of(routes), [])


def test_only_command_messages_are_read_as_commands() -> None:
    routes = changed_routes()
    record = record_of(routes, 0, 2)
    assert command_of(record) is not None
    plain = MessageRecord(
        seq=1,
        id="m-1",
        subject=partition_log(SUBJECT, 0),
        key="k",
        headers={},
        body=record.body,
        body_base64=False,
        producer=None,
        created_at_us=1,
        stored_at_us=1,
        deliver_at_us=0,
    )
    assert command_of(plain) is None
    wrong_partition = MessageRecord(**{**_fields(record), "subject": partition_log(SUBJECT, 1)})
    assert command_of(wrong_partition) is None


def _fields(record: MessageRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in MessageRecord.__dataclass_fields__}


# --- a fenced subject in the book -----------------------------------------------------------


def test_a_fenced_subject_is_ordered_read_only_and_answers_subject_fenced() -> None:
    fence = Fence(why="fenced: restore it", partitions=(0, 1, 2), commands={0: 41})
    other = Routes.create("other", partitions=1, on_dead="skip")
    book = RouteBook({"other": other}, fenced={SUBJECT: fence})
    assert book.is_ordered(SUBJECT)
    assert book.subjects() == ["other"]
    assert book.partitions(SUBJECT) == [0, 1, 2]
    assert book.command_seq(SUBJECT, 0) == 41
    with pytest.raises(Unavailable) as routes_error:
        book.get(SUBJECT)
    assert (routes_error.value.code, routes_error.value.field) == ("subject_fenced", "subject")
    with pytest.raises(Unavailable) as produce_error:
        book.target(SUBJECT, "k", index=3)
    assert produce_error.value.field == "messages[3].subject"
    assert book.target("other", "k", index=0).log == "other#0"
