"""The acceptance tests' acked-order check (``tests/support/acked_order.py``, no Spark)
finds what the reconciliation's ``acked_out_of_order`` finds, on the world of
``test_reconcile_ordered`` (whose test checks the reconciliation against ``acked_early``)."""

from __future__ import annotations

import pytest

from tests.spark.test_reconcile_ordered import GROUP, OUTBOX_ORDER, SLOPPY, World
from tests.spark.test_reconcile_ordered import world as world  # the fixture, shared
from tests.support.acked_order import acked_out_of_order

pytestmark = pytest.mark.spark


def test_it_finds_what_the_reconciliation_finds(world: World) -> None:
    found, judged = acked_out_of_order(world.broker_dir)
    assert {(f["group"], f["message_id"]) for f in found} == {
        (SLOPPY, name) for name in world.acked_early
    }
    assert judged == 2 * len(OUTBOX_ORDER)  # both groups' acks; the command is no message
    assert GROUP not in {f["group"] for f in found}
