"""How an ordered pull's ``max`` is shared out over the partitions a consumer holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qmq_broker.pulls.ordered import share_out


def test_an_even_split_when_every_partition_has_enough() -> None:
    assert share_out(8, [10, 10, 10, 10]) == [2, 2, 2, 2]


def test_what_one_cannot_use_goes_to_the_others() -> None:
    assert share_out(8, [10, 1, 10, 10]) == [3, 1, 2, 2]
    assert share_out(8, [0, 0, 8, 0]) == [0, 0, 8, 0]


def test_a_remainder_goes_to_the_earlier_ones() -> None:
    assert share_out(5, [9, 9, 9]) == [2, 2, 1]
    assert share_out(2, [9, 9, 9]) == [1, 1, 0]


@given(st.integers(1, 1000), st.lists(st.integers(0, 1000), max_size=64))
def test_shares_fill_the_limit_as_far_as_the_partitions_allow(limit: int, wants: list[int]) -> None:
    shares = share_out(limit, wants)
    assert all(0 <= s <= w for s, w in zip(shares, wants, strict=True))
    assert sum(shares) == min(limit, sum(wants))
    # even: a partition short of another's share by more than one had no more to give
    for s, w in zip(shares, wants, strict=True):
        assert s == w or s >= max(shares, default=0) - 1
