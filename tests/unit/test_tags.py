"""Tags in the broker's pure parts: the message record's flag bit and field, the group
state's filter and skips (applied, snapshotted, replayed), the wire rule and the headers."""

from __future__ import annotations

import pytest

from qmq_broker.format.actions import ActionRecord, ActionType
from qmq_broker.format.messages import (
    FLAG_BODY_BASE64,
    FLAG_TAGS,
    MessageRecord,
    message_fields,
    peek_message,
)
from qmq_broker.groups import GroupTable
from qmq_broker.messages import pulled
from qmq_outbox.envelope import OutgoingMessage
from qmq_outbox.transports import headers
from qmq_wire import rules


def record(**extra: object) -> MessageRecord:
    fields: dict[str, object] = {
        "seq": 7,
        "id": "m-7",
        "subject": "orders",
        "key": "k",
        "headers": {"h": "v"},
        "body": b"body",
        "body_base64": False,
        "producer": "p",
        "created_at_us": 1,
        "stored_at_us": 2,
        "deliver_at_us": 0,
    }
    fields.update(extra)
    return MessageRecord(**fields)  # type: ignore[arg-type]


def test_a_record_without_tags_is_laid_out_as_before_tags_existed() -> None:
    plain = record().encode()
    assert plain[1] & FLAG_TAGS == 0
    # the old layout: head, strings, headers, then [u32 length][body] to the end
    assert plain.endswith(len(b"body").to_bytes(4, "little") + b"body")
    assert MessageRecord.decode(plain).tags == ()
    assert "tags" not in pulled(MessageRecord.decode(plain), attempt=1)


def test_a_tagged_record_sets_its_flag_and_round_trips() -> None:
    tagged = record(tags=("red", "vip"), body_base64=True).encode()
    assert tagged[1] == FLAG_TAGS | FLAG_BODY_BASE64
    decoded = MessageRecord.decode(tagged)
    assert decoded == record(tags=("red", "vip"), body_base64=True)
    assert message_fields(tagged)[11] == ("red", "vip")
    assert peek_message(tagged) == (7, 2, "orders", "m-7")  # recovery's peek is unchanged
    assert pulled(decoded, attempt=1)["tags"] == ["red", "vip"]


def group_record(state: str = "", **fields: object) -> ActionRecord:
    return ActionRecord(
        type=ActionType.GROUP,
        at_us=1,
        subject="orders",
        group="g",
        state=state,
        fields={"mode": "shared", "cursor": 0, **fields},
    )


def lease(seqs: tuple[int, ...], **fields: object) -> ActionRecord:
    base = {"consumer": "c", "deadline": 10**12, "attempts": [1] * len(seqs)}
    return ActionRecord(
        type=ActionType.LEASE,
        at_us=2,
        subject="orders",
        group="g",
        seqs=seqs,
        fields={**base, **fields},
    )


def test_skips_ride_on_lease_records_and_survive_a_snapshot() -> None:
    table = GroupTable()
    table.apply(group_record(tags=["red"]))
    table.apply(lease((0, 4), skip_to=5, filtered=3))  # 1, 2, 3 skipped
    table.apply(lease((), skip_to=9, filtered=4))  # a window with no match
    group = table[("orders", "g")]
    state = group.states[""]
    assert (state.cursor, state.filtered, sorted(state.leases)) == (9, 7, [0, 4])
    stats = group.stats(end_seq=12)
    assert (stats.filtered, stats.tags, stats.backlog, stats.in_flight) == (7, ["red"], 3, 2)
    again = GroupTable.restore(table.snapshot())
    restored = again[("orders", "g")]
    assert restored.tags == ("red",)
    assert (restored.states[""].cursor, restored.states[""].filtered) == (9, 7)


def test_old_records_and_checkpoints_mean_no_filter() -> None:
    table = GroupTable()
    table.apply(group_record())
    table.apply(lease((0,)))
    group = table[("orders", "g")]
    assert group.tags == ()
    assert group.states[""].filtered == 0
    old = table.snapshot()
    del old["orders"]["g"]["states"][""]["filtered"]
    assert "tags" not in old["orders"]["g"]
    assert GroupTable.restore(old)[("orders", "g")].tags == ()


def test_a_group_record_on_an_unfixed_group_fixes_its_filter() -> None:
    """After a reset clears the filter (``tags = None``), the next pull's GROUP record fixes
    it again, without touching the existing state's cursor."""
    table = GroupTable()
    table.apply(group_record())
    table.apply(lease((0, 1)))
    table[("orders", "g")].tags = None
    assert table.snapshot()["orders"]["g"]["tags"] is None
    assert GroupTable.restore(table.snapshot())[("orders", "g")].tags is None
    table.apply(group_record(tags=["blue"], cursor=0))
    group = table[("orders", "g")]
    assert (group.tags, group.states[""].cursor) == (("blue",), 2)


@pytest.mark.parametrize(
    ("tags", "wanted", "match"),
    [
        (("a", "b"), ("b", "c"), True),
        (("a",), ("b",), False),
        ((), ("b",), False),
        ((), None, True),
        (("a",), (), True),
    ],
)
def test_tags_match_any_of(tags: tuple[str, ...], wanted: tuple[str, ...], match: bool) -> None:
    assert rules.tags_match(tags, wanted) is match


def test_tags_travel_as_one_header_on_other_transports() -> None:
    message = OutgoingMessage(id="m", subject="s", body=b"", tags=("red", "v.i:p"))
    encoded = headers.encode(message)
    assert encoded[headers.TAGS] == "red,v.i:p"
    decoded = headers.decode(encoded)
    assert (decoded.tags, decoded.headers) == (("red", "v.i:p"), {})
    assert headers.decode({}).tags == ()
