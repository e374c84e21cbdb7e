"""Room (format 4): a real broker allocates its log segments ahead of its appends; after
kill -9 the room stays, recovery reads past it without a problem, appends go on into it,
and a clean stop cuts it off."""

from __future__ import annotations

from pathlib import Path

import orjson

from qmq_broker.format import HEADER_SIZE, SegmentKind, list_segments, walk_frames
from qmq_broker.recovery.verify import verify
from qmq_broker.storage.journal import ROOM_BYTES
from qmq_outbox.client import BrokerClient
from qmq_outbox.envelope import OutgoingMessage
from tests.support.broker_process import BrokerProcess

SUBJECT = "room.orders"


def produce(url: str, first: int, count: int) -> None:
    with BrokerClient(url) as client:
        results = client.produce(
            [
                OutgoingMessage(id=f"m-{n}", subject=SUBJECT, body=f"order {n}".encode())
                for n in range(first, first + count)
            ]
        )
    assert {r.status for r in results} == {"stored"}


def data_end(segment: Path) -> int:
    """Where the segment's frames end."""
    end = HEADER_SIZE
    for item in walk_frames(segment.read_bytes()):
        assert isinstance(item, tuple), f"{segment}: {item}"
        end = item[0] + 8 + len(item[1])
    return end


def recovery_problems(broker: BrokerProcess) -> list[list[str]]:
    found = []
    for line in broker.log_path.read_text().splitlines():
        if '"broker.recovered"' in line:
            found.append(orjson.loads(line)["problems"])
    return found


def test_room_left_by_kill_9_is_read_past_and_filled_and_cut_by_a_clean_stop(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    broker = BrokerProcess(data_dir).start()
    try:
        produce(broker.url, 0, 50)
        (segment,) = list_segments(data_dir, SegmentKind.MESSAGES)
        assert segment.stat().st_size >= ROOM_BYTES  # allocated ahead of the appends
        broker.kill9()
        end = data_end(segment)
        assert segment.stat().st_size > end  # the room survived the kill

        broker.restart()
        produce(broker.url, 50, 50)  # into the room, where the data ended
        with BrokerClient(broker.url) as client:
            pulled = client.pull(SUBJECT, "g", "c", max_messages=100, wait_ms=0)
            client.ack(SUBJECT, "g", "c", [m.seq for m in pulled])
        assert [m.body for m in pulled] == [f"order {n}".encode() for n in range(100)]
        assert broker.terminate() == 0
    finally:
        broker.stop()
    assert recovery_problems(broker) == [[], []]  # neither start found anything wrong
    assert segment.stat().st_size == data_end(segment)  # the clean stop cut the room off
    assert verify(data_dir).clean
