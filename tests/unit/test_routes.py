"""The route table's rules (qmq_wire.routes): every change keeps the four constraints.

1. versions are consecutive; 2. one change at a time; 3. ranges stay contiguous and cover
every logic partition; 4. a closed partition is never routed to again. Plus: a key's logic
partition is stable, and ``holders`` names every partition a key was ever stored in.
"""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmq_wire.ordered import (
    LOGIC_PARTITIONS,
    command_id,
    logic_partition,
    partition_log,
    split_partition_log,
)
from qmq_wire.routes import RouteConflict, Routes


def test_version_one_splits_the_logic_partitions_evenly() -> None:
    routes = Routes.create("orders", partitions=3, on_dead="skip")
    ranges = routes.current.ranges
    assert [(r.lo, r.hi, r.partition) for r in ranges] == [
        (0, 341, 0),
        (341, 682, 1),
        (682, 1024, 2),
    ]
    assert routes.problem() is None
    assert routes.current.partition_of(0) == 0
    assert routes.current.partition_of(340) == 0
    assert routes.current.partition_of(341) == 1
    assert routes.current.partition_of(1023) == 2


def test_split_merge_move_make_consecutive_versions_and_close_what_they_replace() -> None:
    routes = Routes.create("orders", partitions=2, on_dead="skip")
    split = routes.split(1, 700)
    assert split.current.version == 2
    assert split.current.closed == (1,)
    assert [(r.lo, r.hi, r.partition) for r in split.current.ranges] == [
        (0, 512, 0),
        (512, 700, 2),
        (700, 1024, 3),
    ]
    merged = split.merge([3, 2])
    assert merged.current.closed == (2, 3)
    assert [(r.lo, r.hi, r.partition) for r in merged.current.ranges] == [
        (0, 512, 0),
        (512, 1024, 4),
    ]
    moved = merged.move(0)
    assert [(r.lo, r.hi, r.partition) for r in moved.current.ranges] == [
        (0, 512, 5),
        (512, 1024, 4),
    ]
    assert moved.closed() == {1: 2, 2: 3, 3: 3, 0: 4}
    assert moved.problem() is None
    assert Routes.from_doc(moved.to_doc()) == moved


def test_changes_that_break_a_rule_are_refused_naming_the_field() -> None:
    routes = Routes.create("orders", partitions=4, on_dead="skip")
    with pytest.raises(RouteConflict) as caught:
        routes.split(0, 256)  # at must lie strictly inside [0, 256)
    assert caught.value.field == "at"
    with pytest.raises(RouteConflict) as caught:
        routes.split(9, 10)
    assert caught.value.field == "partition"
    with pytest.raises(RouteConflict) as caught:
        routes.merge([0, 2])  # not adjacent
    assert caught.value.field == "partitions"
    with pytest.raises(RouteConflict):
        routes.merge([1, 1])
    closed = routes.move(1)
    with pytest.raises(RouteConflict):
        closed.split(1, 300)  # closed: not open at the current version
    with pytest.raises(RouteConflict):
        closed.merge([1, 2])


def test_a_table_read_from_disk_is_checked() -> None:
    doc = Routes.create("orders", partitions=2, on_dead="skip").split(0, 100).to_doc()
    doc["versions"][1]["ranges"][0][1] = 99  # a gap between two ranges
    with pytest.raises(ValueError, match="contiguous"):
        Routes.from_doc(doc)
    doc = Routes.create("orders", partitions=2, on_dead="skip").to_doc()
    doc["format"] = 7
    with pytest.raises(ValueError, match="format"):
        Routes.from_doc(doc)


def test_logic_partition_is_crc32_of_the_key_modulo_1024() -> None:
    assert logic_partition("order-1") == zlib.crc32(b"order-1") % LOGIC_PARTITIONS
    assert logic_partition("заказ") == zlib.crc32("заказ".encode()) % LOGIC_PARTITIONS
    assert partition_log("a.b", 3) == "a.b#3"
    assert split_partition_log("a.b#3") == ("a.b", 3)
    assert split_partition_log("a.b") == ("a.b", None)
    assert command_id(4, 2) == "_qmq.route.4.2"


_changes = st.lists(
    st.tuples(st.sampled_from(["split", "merge", "move"]), st.integers(0, 10**6)),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(partitions=st.integers(1, 8), changes=_changes, keys=st.lists(st.text(max_size=8)))
def test_any_sequence_of_changes_keeps_the_rules(
    partitions: int, changes: list[tuple[str, int]], keys: list[str]
) -> None:
    routes = Routes.create("s", partitions=partitions, on_dead="skip")
    for kind, pick in changes:
        current = routes.current
        ranges = current.ranges
        chosen = ranges[pick % len(ranges)]
        try:
            if kind == "split":
                routes = routes.split(chosen.partition, chosen.lo + 1 + pick % LOGIC_PARTITIONS)
            elif kind == "merge":
                other = ranges[(pick // 7) % len(ranges)]
                routes = routes.merge([chosen.partition, other.partition])
            else:
                routes = routes.move(chosen.partition)
        except RouteConflict:
            assert routes.current is current  # a refused change changes nothing
            continue
        assert routes.current.version == current.version + 1
        assert routes.problem() is None
        closed = set(routes.current.closed)
        # one change at a time: it replaced one range (split, move) or two adjacent ones
        assert len(closed) == (2 if kind == "merge" else 1)
        assert closed <= set(current.partitions)
        assert not closed & set(routes.current.partitions)
    assert Routes.from_doc(routes.to_doc()) == routes
    for key in keys:
        logic = logic_partition(key)
        holders = routes.holders(logic)
        assert holders[0] == routes.current.partition_of(logic)
        every = {v.partition_of(logic) for v in routes.versions}
        assert set(holders) == every
