"""``qmq group reset`` as a process against a real broker: each position, --force, the
answer printed; a refused or malformed call is one line with its exit code."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from qmq_outbox import BrokerClient, OutgoingMessage
from tests.acceptance.test_cli_subject import ok, one_line, qmq
from tests.support.broker_process import BrokerProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path_factory.mktemp("cli-group") / "data")
    process.start()
    yield process
    process.stop()


def reset(url: str, *args: str) -> list[str]:
    return ["group", "reset", "--subject", "orders", "--group", "billing", "--url", url, *args]


def test_reset_to_each_position_and_with_force(broker: BrokerProcess) -> None:
    url = broker.url
    with BrokerClient(url) as client:
        for i in range(5):  # one produce each: stored times of their own
            client.produce([OutgoingMessage(id=f"m-{i}", subject="orders", body=b"")])
            time.sleep(0.002)
        pulled = client.pull("orders", "billing", "c1", max_messages=5)
        client.ack("orders", "billing", "c1", [m.seq for m in pulled])
    assert ok(qmq(*reset(url, "--to-seq", "2"))).splitlines() == [
        "group billing on orders: reset, 0 leases dropped",
        "  group                    next seq 2",
    ]
    stored_at = pulled[3].stored_at
    assert stored_at is not None
    answer = json.loads(ok(qmq(*reset(url, "--to-time", stored_at.isoformat(), "--json"))))
    assert answer == {
        "positions": [{"partition": None, "consumer": None, "seq": 3}],
        "dropped_leases": 0,
    }
    assert "next seq 5" in ok(qmq(*reset(url, "--latest")))
    assert "next seq 0" in ok(qmq(*reset(url, "--earliest")))
    with BrokerClient(url) as client:
        assert len(client.pull("orders", "billing", "c1", max_messages=2)) == 2
    busy = one_line(qmq(*reset(url, "--to-seq", "4")), 2)
    refused = f"qmq group reset: error: {url}: broker answered 409 group_busy (force):"
    assert busy.startswith(refused)
    forced = ok(qmq(*reset(url, "--to-seq", "4", "--force")))
    assert forced.splitlines()[0] == "group billing on orders: reset, 2 leases dropped"


def test_bad_input_is_one_line_and_exit_2(broker: BrokerProcess) -> None:
    url = broker.url
    none = one_line(qmq(*reset(url)), 2)
    assert none == (
        "qmq group reset: error: give exactly one of --to-seq, --to-time, --earliest, --latest"
    )
    two = one_line(qmq(*reset(url, "--earliest", "--latest")), 2)
    assert "exactly one of" in two
    bad_time = one_line(qmq(*reset(url, "--to-time", "yesterday")), 2)
    assert "is not an RFC 3339 time" in bad_time
    unknown = one_line(
        qmq("group", "reset", "--subject", "orders", "--group", "nobody", "--url", url, "--latest"),
        2,
    )
    assert "404 group_not_found (group)" in unknown
