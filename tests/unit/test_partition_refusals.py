"""A partition an ordered subject does not have: acks, nacks, dead letters and resets that
name it are refused alike (``partition_not_found``), on a broker in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from qmq_broker.engine import Broker
from qmq_broker.errors import NotFound
from qmq_wire.rules import Position
from tests.support.engine import join_ordered, run_broker


def test_every_call_naming_a_missing_partition_is_refused(tmp_path: Path) -> None:
    async def script(broker: Broker) -> None:
        await join_ordered(broker, "ledger", "posting", "p1")
        services = broker.services
        delivery, named = services.delivery, {"subject": "ledger", "group": "posting"}
        calls = [
            delivery.ack(**named, consumer="p1", seqs=[1], partition=9),
            delivery.nack(**named, consumer="p1", seqs=[1], delay_ms=None, error=None, partition=9),
            services.resets.reset(**named, to=Position(kind="earliest"), force=False, partition=9),
        ]
        for call in calls:
            with pytest.raises(NotFound) as refused:
                await call
            assert (refused.value.code, refused.value.field) == ("partition_not_found", "partition")
            assert refused.value.message == "'ledger' has no partition 9"
        with pytest.raises(NotFound, match="has no partition 9"):
            delivery.dead_letters(**named, limit=10, after_seq=None, partition=9)
        answer = await services.resets.reset(
            **named, to=Position(kind="earliest"), force=False, partition=1
        )
        assert [position.partition for position in answer.positions] == [1]

    run_broker(tmp_path / "data", script)
