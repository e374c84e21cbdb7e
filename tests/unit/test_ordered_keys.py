"""Per-key concurrency in an ordered partition (``qmq_wire.keyed``) on the broker's delivery
state: which seqs a pull leases, and the skipped seqs rebuilt from action records alone."""

from __future__ import annotations

from typing import Any

from qmq_broker.format.actions import ActionRecord, ActionType
from qmq_broker.groups import DeliveryState, GroupTable
from qmq_wire.keyed import LOOK_AHEAD, MAX_SKIPPED, choose_keyed, first_of_each_key

NOW = 1_000_000
KEYS = "abacbdaaef"  # the key of seq n is KEYS[n]


def choose(state: DeliveryState, keys: str = KEYS, **options: Any) -> list[int]:
    chosen = options | {"limit": options.get("limit", 100), "max_keys": options.get("max_keys", 16)}
    seqs, _ = choose_keyed(
        state,
        key_of=lambda seq: keys[seq],
        end=chosen.pop("end", len(keys)),
        now_us=NOW,
        block_dead=chosen.pop("block_dead", False),
        **chosen,
    )
    return seqs


def record(kind: ActionType, seqs: list[int], **fields: Any) -> ActionRecord:
    return ActionRecord(
        type=kind, at_us=NOW, subject="s#0", group="g", state="", seqs=tuple(seqs), fields=fields
    )


def lease(state: DeliveryState, seqs: list[int], attempt: int = 1) -> None:
    fields = {"consumer": "c", "deadline": NOW * 10, "attempts": [attempt] * len(seqs)}
    state.apply(record(ActionType.LEASE, seqs, **fields))


def test_a_fresh_partition_serves_every_key_with_its_consecutive_messages() -> None:
    assert choose(DeliveryState(0)) == list(range(len(KEYS)))


def test_a_busy_key_is_passed_over_and_its_later_messages_wait_behind_it() -> None:
    state = DeliveryState(0)
    lease(state, [0])  # a0 out
    assert choose(state, end=4) == [1, 3]  # b1, c3: a2 waits for a0
    lease(state, [1, 3])
    assert (state.cursor, state.skipped) == (4, {2})
    state.apply(record(ActionType.ACK, [0]))
    assert choose(state) == [2, 5, 6, 7, 8, 9]  # a's turn again, b4 still waits for b1
    lease(state, [2, 5, 6, 7, 8, 9])
    assert state.skipped == {4}


def test_a_retry_holds_back_its_key_only_until_it_is_due() -> None:
    state = DeliveryState(0)
    lease(state, [0, 1])
    state.apply(record(ActionType.RETRY, [0], due=NOW + 1, error="x"))  # a0 later
    assert choose(state) == [3, 5, 8, 9]  # c3, d5, e8, f9: a and b wait
    state.apply(record(ActionType.RETRY, [0], due=NOW, error="x"))  # a0 due now
    state.apply(record(ActionType.ACK, [1]))
    seqs, attempts = choose_keyed(
        state, key_of=lambda s: KEYS[s], limit=3, max_keys=16, end=10, now_us=NOW, block_dead=False
    )
    assert (seqs, attempts) == ([0, 2, 3], [2, 1, 1])


def test_max_keys_bounds_the_keys_in_flight_retries_included() -> None:
    state = DeliveryState(0)
    assert choose(state, max_keys=2) == [0, 1, 2, 4, 6, 7]  # a and b only
    lease(state, [0])
    state.apply(record(ActionType.RETRY, [0], due=NOW + 1, error="x"))
    assert choose(state, max_keys=2) == [1, 4]  # a retrying counts: b alone, with its next
    assert choose(state, max_keys=1) == []


def test_dead_letters_hold_their_key_only_when_the_subject_blocks() -> None:
    state = DeliveryState(0)
    lease(state, [0])
    state.apply(record(ActionType.DEAD, [0], error="x"))
    assert choose(state, block_dead=True) == [1, 3, 4, 5, 8, 9]
    assert choose(state, block_dead=False) == list(range(1, 10))
    state.apply(record(ActionType.REDRIVE, [0]))
    assert choose(state, block_dead=True)[:3] == [0, 1, 2]


def test_the_skipped_messages_and_the_look_ahead_are_bounded() -> None:
    keys = "ax" + "x" * (LOOK_AHEAD + 5) + "b"
    state = DeliveryState(0)
    lease(state, [0, 1])
    state.apply(record(ActionType.ACK, [0]))  # x busy: b lies beyond what a pull passes over
    assert choose(state, keys=keys) == []
    cursor = MAX_SKIPPED + 10
    near = DeliveryState(cursor)
    lease(near, [2])
    near.skipped = set(range(10, 10 + MAX_SKIPPED - 1))  # x's, one short of the bound
    keys = "x" * cursor + "axxb"
    assert choose(near, keys=keys) == [cursor]  # b would skip one too many: it waits
    keys = "x" * cursor + "axb"
    assert choose(near, keys=keys) == [cursor, cursor + 2]


def test_skipped_seqs_are_rebuilt_by_replay_and_kept_by_a_checkpoint() -> None:
    live = GroupTable()
    records = [
        ActionRecord(
            type=ActionType.GROUP,
            at_us=NOW,
            subject="s#0",
            group="g",
            state="",
            fields={"mode": "shared", "cursor": 0},
        ),
        record(ActionType.LEASE, [0], consumer="c", deadline=NOW * 10, attempts=[1]),
        record(ActionType.LEASE, [1, 3, 6], consumer="c", deadline=NOW * 10, attempts=[1] * 3),
        record(ActionType.ACK, [0, 1]),
        record(ActionType.LEASE, [2], consumer="c", deadline=NOW * 10, attempts=[1]),
    ]
    for one in records:
        live.apply(one)
    state = live[("s#0", "g")].states[""]
    assert (state.cursor, state.skipped) == (7, {4, 5})
    assert live[("s#0", "g")].stats(end_seq=10).backlog == 3 + 2
    restored = GroupTable.restore(live.snapshot())[("s#0", "g")].states[""]
    assert (restored.cursor, restored.skipped) == (7, {4, 5})
    old = live.snapshot()
    del old["s#0"]["g"]["states"][""]["skipped"]  # a checkpoint written before issue 39
    assert GroupTable.restore(old)[("s#0", "g")].states[""].skipped == set()


def test_retention_drops_skipped_seqs_it_removed() -> None:
    state = DeliveryState(0)
    lease(state, [5])
    assert state.skipped == {0, 1, 2, 3, 4}
    state.skip_below(3)
    assert state.skipped == {3, 4}


def test_a_nack_counts_an_attempt_for_the_first_of_each_key_only() -> None:
    first, rest = first_of_each_key([4, 0, 1, 2], key_of=lambda seq: KEYS[seq])
    assert (first, rest) == ([0, 1], [2, 4])  # a0, b1 count; a2, b4 never ran
    state = DeliveryState(0)
    lease(state, [0, 1, 2, 4], attempt=2)
    state.apply(record(ActionType.RETRY, first, due=NOW + 5, error="x"))
    state.apply(record(ActionType.RETRY, rest, due=NOW, error="x", released=True))
    assert {seq: r.attempts for seq, r in state.retries.items()} == {0: 2, 1: 2, 2: 1, 4: 1}
    assert choose(state) == [3, 5, 8, 9]  # a and b wait for their first, not yet due
