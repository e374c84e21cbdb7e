"""The console's core: the bounded history, consumers seen, and the views over a real
in-process broker (rates, backlog, oldest unacked message, partition owners); the asset
server's headers and the same-origin rule of the request guard."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from qmq_broker.config import BrokerConfig
from qmq_broker.console.history import History
from qmq_broker.console.http import CONTENT_SECURITY_POLICY, load_assets
from qmq_broker.console.recent_consumers import RecentConsumers
from qmq_broker.engine import Broker
from qmq_broker.http.app import create_app
from qmq_broker.http.guard import GuardPolicy
from qmq_broker.http.hot import HotRoutes
from qmq_broker.metrics import BrokerMetrics
from tests.support.engine import incoming, join_ordered, run_broker


def test_history_keeps_the_newest_samples_in_order() -> None:
    history = History(capacity=3, max_series=10)
    for at in range(5):
        history.record(float(at), {"a": at * 10})
    assert history.times() == [2.0, 3.0, 4.0]
    assert history.values("a") == [20, 30, 40]
    assert history.latest("a") == 40
    assert history.values("never") == [None, None, None]


def test_a_series_has_gaps_where_it_had_no_value_and_goes_after_a_whole_window() -> None:
    history = History(capacity=3, max_series=10)
    history.record(0.0, {"a": 1})
    history.record(1.0, {"a": 2, "b": 5})
    history.record(2.0, {"b": 6})
    assert history.values("a") == [1, 2, None]
    assert history.values("b") == [None, 5, 6]
    history.record(3.0, {"b": 7})
    assert "a" in history  # its 2 is still in the window
    history.record(4.0, {"b": 8})
    assert "a" not in history
    assert history.latest("a") is None


def test_series_beyond_the_cap_are_not_tracked() -> None:
    history = History(capacity=4, max_series=2)
    history.record(0.0, {"a": 1, "b": 1, "c": 1})
    assert history.series_count == 2
    assert history.untracked == 1
    history.record(1.0, {"c": 1})  # a and b remain until they leave the window
    assert "c" not in history
    for at in range(2, 6):
        history.record(float(at), {"c": 1})
    assert "c" in history
    assert history.untracked == 0


def test_sightings_list_the_latest_first_within_the_window_and_stay_bounded() -> None:
    now = [0.0]
    seen = RecentConsumers(now=lambda: now[0], per_group=2, max_groups=2)
    seen.saw("orders", "billing", "a")
    now[0] = 5.0
    seen.saw("orders", "billing", "b")
    now[0] = 10.0
    assert [s.consumer for s in seen.recent("orders", "billing", within_s=60)] == ["b", "a"]
    assert [s.consumer for s in seen.recent("orders", "billing", within_s=6)] == ["b"]
    seen.saw("orders", "billing", "c")  # a makes room
    assert {s.consumer for s in seen.recent("orders", "billing", within_s=60)} == {"b", "c"}
    seen.saw("orders", "audit", "x")
    seen.saw("payments", "audit", "y")  # the group heard from longest ago makes room
    assert seen.recent("orders", "billing", within_s=60) == []
    assert seen.recent("payments", "audit", within_s=60)[0].seconds_ago == 0.0


def test_the_views_over_a_real_broker(tmp_path: Path) -> None:
    async def script(broker: Broker) -> None:
        console = broker.services.console
        await console.sample()  # the first sample: counters, no rates yet
        await broker.services.producer.produce([incoming(i) for i in range(10)])
        pulled, _ = await broker.services.delivery.ack_and_pull(
            ack=None,
            subject="orders",
            group="billing",
            consumer="c1",
            max_messages=4,
            wait_ms=0,
            mode="shared",
            start="earliest",
        )
        await broker.services.delivery.ack(
            subject="orders", group="billing", consumer="c1", seqs=[0, 1]
        )
        broker.recent_consumers.saw("orders", "billing", "c1")
        await asyncio.sleep(0.01)
        await console.sample()
        overview = console.overview()
        (orders,) = overview["subjects"]
        assert (orders["messages"], orders["groups"], orders["backlog"]) == (10, 1, 6)
        assert (orders["in_flight"], orders["dead"]) == (2, 0)
        assert orders["in_per_s"] > 0  # 10 stored between the two samples
        assert orders["out_per_s"] > 0
        assert orders["oldest_unacked_age_s"] is not None  # seq 2, leased, not acked
        assert overview["status"] == "ready"
        assert overview["disk"]["data_bytes"] > 0
        assert overview["fsync"]["fsyncs"] >= 1  # the produce and the ack each fsynced
        assert console.overview(sees=lambda subject, group: False)["subjects"] == []
        (hidden,) = console.overview(sees=lambda subject, group: group is None)["subjects"]
        assert (hidden["groups"], hidden["backlog"], hidden["out_per_s"]) == (0, 0, None)
        view = console.subject("orders")
        (billing,) = view["groups"]
        assert [c["consumer"] for c in billing["consumers"]] == ["c1"]
        (backlog,) = view["history"]["backlog"]
        assert backlog["group"] == "billing"
        assert backlog["values"][-1] == 6  # earlier samples (the loop's first) had no group
        assert len(view["history"]["at"]) == len(backlog["values"]) >= 2
        assert view["ordered"] is False
        assert view["partitions"] == []
        assert len(pulled) == 4

    run_broker(tmp_path / "data", script, console_sample_interval_s=3600)


def test_an_ordered_subjects_partition_owners(tmp_path: Path) -> None:
    async def script(broker: Broker) -> None:
        await join_ordered(broker, "ledger", "posting", "p1")
        view = broker.services.console.subject("ledger")
        assert view["ordered"] is True
        owners = [(p["group"], p["partition"], p["consumer"]) for p in view["partitions"]]
        assert owners == [("posting", 0, "p1"), ("posting", 1, "p1")]
        assert all(p["lease_left_s"] > 0 for p in view["partitions"])

    run_broker(tmp_path / "data", script, console_sample_interval_s=3600)


@pytest.fixture
def app(tmp_path: Path) -> HotRoutes:
    """The broker's app, not started: the page and the guard need none of its services."""
    broker = Broker(BrokerConfig(data_dir=tmp_path / "data"), metrics=BrokerMetrics())
    return create_app(broker, guard=GuardPolicy.for_bind("127.0.0.1", allow_origins=()))


def _client(app: HotRoutes) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8931"
    )


async def test_the_page_is_served_with_a_strict_policy(app: HotRoutes) -> None:
    async with _client(app) as client:
        page = await client.get("/console")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "script-src 'self'" in CONTENT_SECURITY_POLICY
        assert page.headers["x-content-type-options"] == "nosniff"
        again = await client.get("/console", headers={"if-none-match": page.headers["etag"]})
        assert again.status_code == 304
        script = await client.get("/console/main.js")
        assert script.headers["content-type"] == "text/javascript; charset=utf-8"
        assert (await client.get("/console/..%2Fhttp.py")).status_code == 404
        missing = await client.get("/console/nothing.js")
        assert missing.json()["error"]["code"] == "not_found"
    assert set(load_assets()) >= {"index.html", "main.js", "console.css"}


async def test_the_broker_s_own_origin_passes_the_guard_and_others_do_not(
    app: HotRoutes,
) -> None:
    async with _client(app) as client:
        own = await client.get("/console", headers={"origin": "http://127.0.0.1:8931"})
        assert own.status_code == 200
        for origin in ("http://127.0.0.1:9999", "https://127.0.0.1:8931", "http://evil.example"):
            refused = await client.get("/console", headers={"origin": origin})
            assert refused.status_code == 403, origin
            assert refused.json()["error"]["code"] == "origin_not_allowed"
