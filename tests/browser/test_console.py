"""The operator's console in Chromium against real broker processes with real traffic
(issue 19): live figures, a backlog rising and falling, dead letters redriven, markup in a
message shown as text, an action refused to a read-only token; and the delayed and routes
pages."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest
from playwright.sync_api import Locator, Page, expect

from qmq_outbox import Message
from qmq_outbox.client import BrokerClient
from tests.browser.traffic import Producer, consuming, delayed, message, order
from tests.support.broker_process import BrokerProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.browser
Start = Callable[..., BrokerProcess]
NO_FIGURE = "\u2013"  # an en dash: what the console shows before a figure is known


def number(locator: Locator) -> int:
    return int(locator.inner_text().replace(",", ""))


def figure(locator: Locator) -> float:
    """A rate as shown (``1,234.5``); 0 while it is not known yet."""
    text = locator.inner_text().replace(",", "")
    return 0.0 if text == NO_FIGURE else float(text)


def dead(client: BrokerClient, subject: str, group: str) -> int:
    """A group's dead letters as the API counts them (0 before the group's first pull)."""
    groups = client.subject(subject)["groups"]
    return sum(g["dead"] for g in groups if g["group"] == group)


def mark_page(page: Page) -> None:
    """A marker a reload would wipe: the figures must change without one."""
    page.evaluate("window.__notReloaded = true")


def assert_not_reloaded(page: Page) -> None:
    assert page.evaluate("window.__notReloaded") is True


def ok(message: Message) -> None:
    """A handler that always succeeds."""


def test_the_overview_follows_real_traffic(page: Page, console_broker: Start) -> None:
    broker = console_broker()
    with (
        BrokerClient(broker.url) as client,
        Producer(client, ["orders", "payments"]),
        consuming(broker.url, "billing", "orders", ok),
    ):
        page.goto(f"{broker.url}/console")
        mark_page(page)
        orders = page.locator('tr[data-subject="orders"]')
        expect(orders).to_be_visible()
        expect(page.locator('tr[data-subject="payments"]')).to_be_visible()
        expect(page.locator('[data-metric="health"] .value')).to_have_text("ok")
        expect(page.locator("#health")).to_have_text("healthy")
        # Rates come from the second sample on; both directions move for a consumed subject.
        expect(orders.locator('[data-col="in_per_s"]')).not_to_have_text(NO_FIGURE)
        wait_until(lambda: figure(orders.locator('[data-col="out_per_s"]')) > 0, 15)
        expect(page.locator('[data-metric="disk"] .value')).to_contain_text("B")
        expect(page.locator('[data-metric="fsync"] .value')).to_contain_text("ms")
        first = number(orders.locator('[data-col="messages"]'))
        wait_until(lambda: number(orders.locator('[data-col="messages"]')) > first, 10)
        # Nobody consumes payments: its backlog only grows, and its oldest message ages.
        expect(page.locator('tr[data-subject="payments"] [data-col="groups"]')).to_have_text("0")
        assert_not_reloaded(page)


def test_a_groups_backlog_rises_and_falls(page: Page, console_broker: Start) -> None:
    broker = console_broker()
    with BrokerClient(broker.url) as client:
        client.pull("orders", "billing", "warm-up", max_messages=1)  # the group exists, empty
        page.goto(f"{broker.url}/console#/subjects/orders")
        mark_page(page)
        backlog = page.locator('tr[data-group="billing"] [data-col="backlog"]')
        expect(backlog).to_have_text("0")
        with Producer(client, ["orders"], batch=20, every_s=0.05) as producer:
            wait_until(lambda: number(backlog) >= 200, 15)
        wait_until(lambda: number(backlog) == producer.sent, 10)
        risen = producer.sent
        with consuming(broker.url, "billing", "orders", ok, consumer_id="billing-1"):
            expect(backlog).to_have_text("0")
            expect(page.locator('tr[data-group="billing"] [data-col="acked"]')).to_have_text(
                f"{risen:,}"
            )
            expect(page.locator('tr[data-group="billing"] [data-col="consumers"]')).to_contain_text(
                "billing-1"
            )
        # The chart draws the sampled history, which saw the rise and the fall too.
        expect(page.locator("figure.chart polyline.line").first).to_be_visible()

        def sampled() -> list[int]:
            doc = httpx.get(f"{broker.url}/v1/console/subjects/orders", timeout=5).json()
            return [v for v in doc["history"]["backlog"][0]["values"] if v is not None]

        wait_until(lambda: sampled()[-1] == 0, 5)
        assert max(sampled()) >= 200
        assert_not_reloaded(page)


def test_dead_letters_are_shown_and_one_redriven_is_delivered(
    page: Page, console_broker: Start
) -> None:
    broker = console_broker()
    healed = threading.Event()
    delivered: list[str] = []

    def charge(message: Message) -> None:
        if not healed.is_set():
            raise RuntimeError(f"card declined for order {message.json()['order_id']}")
        delivered.append(message.id)

    with BrokerClient(broker.url) as client:
        sent = client.produce([order("payments", i) for i in range(3)])
        with consuming(broker.url, "charging", "payments", charge):
            wait_until(lambda: dead(client, "payments", "charging") == 3, 15)
            page.goto(f"{broker.url}/console#/subjects/payments/groups/charging/dead")
            mark_page(page)
            rows = page.locator("table.dead tbody tr")
            expect(rows).to_have_count(3)
            chosen = page.locator('tr[data-seq="1"]')
            error = chosen.locator('[data-col="error"]')
            expect(error).to_contain_text("card declined for order 1")
            expect(chosen.locator('[data-col="attempts"]')).to_have_text("1")
            expect(chosen.locator('[data-col="body"] pre')).to_have_text(
                '{"order_id": 1, "amount": 11}'
            )
            healed.set()
            chosen.locator('input[type="checkbox"]').check()
            expect(page.locator("#redrive-selected")).to_have_text("Redrive selected (1)")
            page.locator("#redrive-selected").click()
            expect(page.locator(".notice")).to_contain_text("Redriven 1")
            expect(rows).to_have_count(2)
            expect(page.locator('tr[data-seq="1"]')).to_have_count(0)
            wait_until(lambda: delivered == [sent[1].id], 15)
            page.goto(f"{broker.url}/console#/subjects/payments")
            group = page.locator('tr[data-group="charging"]')
            expect(group.locator('[data-col="dead"]')).to_have_text("2")
            expect(group.locator('[data-col="acked"]')).to_have_text("1")
            assert_not_reloaded(page)


MARKUP = "<script>window.__pwned = 'body'</script><img src=x onerror=\"window.__pwned='img'\">"


def test_markup_in_a_message_is_shown_as_text(page: Page, console_broker: Start) -> None:
    broker = console_broker()
    long_body = ("<b>" + "x" * 3000 + "</b>").encode()

    def refuse(message: Message) -> None:
        raise ValueError("<img src=x onerror=\"window.__pwned='error'\">")

    with BrokerClient(broker.url) as client:
        client.produce(
            [
                message(
                    "payments",
                    MARKUP.encode(),
                    headers={"note": "<script>window.__pwned='header'</script>"},
                    key="<i>customer</i>",
                ),
                message("payments", long_body),
            ]
        )
        with consuming(broker.url, "audit", "payments", refuse, consumer_id="<b>auditor</b>"):
            wait_until(lambda: dead(client, "payments", "audit") == 2, 15)
            answer = page.goto(f"{broker.url}/console#/subjects/payments/groups/audit/dead")
            assert answer is not None
            policy = answer.headers["content-security-policy"]
            assert "default-src 'self'" in policy
            assert "script-src 'self'" in policy
            first = page.locator('tr[data-seq="0"]')
            expect(first.locator('[data-col="body"] pre')).to_have_text(MARKUP)
            expect(first.locator('[data-col="message"]')).to_contain_text(
                "note: <script>window.__pwned='header'</script>"
            )
            expect(first.locator('[data-col="message"]')).to_contain_text("<i>customer</i>")
            expect(first.locator('[data-col="error"]')).to_contain_text("<img src=x onerror=")
            cut = page.locator('tr[data-seq="1"] [data-col="body"]')
            expect(cut.locator("pre")).to_have_text(long_body.decode()[:1024])
            expect(cut.locator(".note")).to_contain_text("cut: first 1,024 of 3,007 characters")
            page.goto(f"{broker.url}/console#/subjects/payments")
            expect(page.locator('tr[data-group="audit"] [data-col="consumers"]')).to_contain_text(
                "<b>auditor</b>"
            )
        assert page.locator("main script, main img, main b, main i").count() == 0
        assert page.evaluate("window.__pwned") is None


TOKENS = [
    {"name": "viewer", "token": "viewer-token", "consume": ["*"]},
    {"name": "ops", "token": "ops-token", "manage": ["*"]},
    {"name": "root", "token": "root-token", "admin": True},
]


def test_a_read_only_token_is_refused_an_action(page: Page, console_broker: Start) -> None:
    broker = console_broker(tokens=TOKENS)
    with BrokerClient(broker.url, token="root-token") as client:
        client.produce([order("payments", i) for i in range(2)])
        pulled = client.pull("payments", "charging", "worker-1", max_messages=2)
        client.nack("payments", "charging", "worker-1", [m.seq for m in pulled], error="declined")
        assert dead(client, "payments", "charging") == 2
        page.goto(f"{broker.url}/console#/subjects/payments/groups/charging/dead")
        expect(page.locator("#token-form")).to_be_visible()  # the broker answered 401
        page.locator("#token").fill("viewer-token")
        page.locator("#token-form button[type=submit]").click()
        expect(page.locator(".refusal")).to_contain_text("Dead letters: 403 forbidden")
        page.locator("#redrive-all").click()
        refused = page.locator(".refusal", has_text="Redrive refused")
        expect(refused).to_contain_text("403 forbidden")
        expect(refused).to_contain_text("token 'viewer' may not manage")
        assert dead(client, "payments", "charging") == 2  # nothing was redriven
        # The same token reads what it may: the subject and its group.
        page.goto(f"{broker.url}/console#/subjects/payments")
        expect(page.locator('tr[data-group="charging"] [data-col="dead"]')).to_have_text("2")
        # A manage token may redrive them.
        page.locator("#forget-token").click()
        page.goto(f"{broker.url}/console#/subjects/payments/groups/charging/dead")
        page.locator("#token").fill("ops-token")
        page.locator("#token-form button[type=submit]").click()
        expect(page.locator("table.dead tbody tr")).to_have_count(2)
        page.locator("#redrive-all").click()
        expect(page.locator(".notice")).to_contain_text("Redriven 2")
        assert dead(client, "payments", "charging") == 0


def test_the_delayed_and_routes_pages(page: Page, console_broker: Start) -> None:
    broker = console_broker()
    with BrokerClient(broker.url) as client:
        client.produce(delayed("reminders", 30, hours=3))
        client.declare_subject("ledger", partitions=2)
        client.produce([order("ledger", i, key=f"account-{i}") for i in range(20)])
        page.goto(f"{broker.url}/console#/delayed")
        hours = page.locator("table.hours tbody tr")
        expect(hours).to_have_count(3)
        counts = [number(hours.nth(i).locator('[data-col="messages"]')) for i in range(3)]
        assert sum(counts) == 30
        expect(page.locator('[data-metric="unreadable"] .value')).to_have_text("0")
        with consuming(broker.url, "posting", "ledger", ok, consumer_id="poster-1", ordered=True):
            page.goto(f"{broker.url}/console#/subjects/ledger/routes")
            owners = page.locator('table.ranges [data-col="owner"][data-group="posting"]')
            expect(owners).to_have_count(2)
            for index in range(2):
                expect(owners.nth(index)).to_contain_text("poster-1")
        # An ordered subject's dead letters are kept per partition: the page offers them.
        page.goto(f"{broker.url}/console#/subjects/ledger/groups/posting/dead")
        page.get_by_role("link", name="partition 1").click()
        expect(page.locator("h1")).to_contain_text("partition 1")
        expect(page.get_by_text("No dead letters.")).to_be_visible()
