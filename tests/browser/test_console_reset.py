"""The console's group reset in Chromium against a real broker: a reset to a seq after its
confirmation, the messages from there delivered again; a 409 while a message is leased
out, and the forced reset that drops the lease."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from playwright.sync_api import Page, expect

from qmq_outbox import OutgoingMessage
from qmq_outbox.client import BrokerClient
from tests.support.broker_process import BrokerProcess

pytestmark = pytest.mark.browser
Start = Callable[..., BrokerProcess]


def test_a_group_is_reset_after_a_confirmation(page: Page, console_broker: Start) -> None:
    broker = console_broker()
    with BrokerClient(broker.url) as client:
        for i in range(3):
            client.produce([OutgoingMessage(id=f"o-{i}", subject="orders", body=b"{}")])
        pulled = client.pull("orders", "billing", "c1", max_messages=3)
        client.ack("orders", "billing", "c1", [m.seq for m in pulled])

        page.goto(f"{broker.url}/console#/subjects/orders")
        page.locator('tr[data-group="billing"] [data-col="actions"] a').click()
        expect(page.locator("h1")).to_contain_text("Reset billing on orders")
        page.get_by_label("From a seq").check()
        seq = page.locator("#reset-seq")
        seq.fill("1")
        time.sleep(2.5)  # a refresh in between keeps what was typed
        expect(seq).to_have_value("1")
        page.locator("#reset-group").click()
        confirm = page.get_by_role("alertdialog")
        expect(confirm).to_contain_text("Reset group billing on orders to seq 1?")
        assert client.pull("orders", "billing", "c1", max_messages=3) == []  # not yet
        page.locator("#reset-confirm").click()
        expect(page.locator(".notice")).to_contain_text("Reset to seq 1: next seq 1; 0 leases")
        again = client.pull("orders", "billing", "c1", max_messages=3)
        assert [m.id for m in again] == ["o-1", "o-2"]  # leased now: the next reset is refused

        page.get_by_label("Earliest").check()
        page.locator("#reset-group").click()
        page.locator("#reset-confirm").click()
        expect(page.locator(".refusal")).to_contain_text("409 group_busy")
        expect(page.locator(".refusal")).to_contain_text("force")
        page.locator("#reset-force").check()
        page.locator("#reset-group").click()
        expect(page.get_by_role("alertdialog")).to_contain_text("dropping its leases")
        page.locator("#reset-confirm").click()
        expect(page.locator(".notice")).to_contain_text("next seq 0; 2 leases dropped")
        assert client.ack("orders", "billing", "c1", [1, 2])["unknown"] == [1, 2]
        assert [m.id for m in client.pull("orders", "billing", "c1", max_messages=5)] == [
            "o-0",
            "o-1",
            "o-2",
        ]
