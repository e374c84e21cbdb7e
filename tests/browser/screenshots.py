"""The screenshots of docs/console.md, taken against a real broker with real traffic.

    .venv/bin/python -m tests.browser.screenshots [--out docs/images]

Starts a broker (sampling every second), produces to ``orders``, ``payments`` and the
ordered ``ledger``, schedules ``reminders``, runs consumers (``billing`` stops for a while so
its backlog rises and falls; ``charging`` declines some payments, one of them a body with
markup, into the dead letters), then photographs each page. About a minute.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from qmq_outbox import Message
from qmq_outbox.client import BrokerClient
from tests.browser.chromium import CHROMIUM, SAMPLE_ARGS
from tests.browser.traffic import Producer, consuming, delayed, message
from tests.support.broker_process import BrokerProcess

PHASE_S = 15.0
PAGES = [  # file name, console page, what shows it loaded
    ("overview", "", "table.subjects"),
    ("subject", "#/subjects/orders", "figure svg"),
    ("dead-letters", "#/subjects/payments/groups/charging/dead", "table.dead"),
    ("delayed", "#/delayed", "table.hours"),
    ("routes", "#/subjects/ledger/routes", "table.ranges"),
]
MARKUP = b'{"order_id": "<script>alert(1)</script>", "note": "<img src=x onerror=alert(2)>"}'


def decline(message: Message) -> None:
    order = message.json()["order_id"]
    if not isinstance(order, int) or order % 25 == 3:
        raise ValueError(f"card declined for order {order!r}")


def post(message: Message) -> None:
    time.sleep(0.002)


def shoot(page: Page, url: str, name: str, out: Path, *, ready: str) -> None:
    page.goto(url)
    page.wait_for_selector(ready)
    time.sleep(2.5)  # one more refresh, so the figures are live ones
    page.screenshot(path=str(out / f"console-{name}.png"), full_page=False)
    print(f"wrote {out / f'console-{name}.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        extra = [*SAMPLE_ARGS, "--max-attempts", "2"]
        broker = BrokerProcess(Path(root) / "data", extra_args=extra)
        broker.start()
        try:
            run(broker, args.out)
        finally:
            broker.stop()


def run(broker: BrokerProcess, out: Path) -> None:
    url = broker.url
    with BrokerClient(url) as client:
        client.declare_subject("ledger", partitions=4)
        client.produce(delayed("reminders", 240, hours=6))
        client.produce([message("payments", MARKUP, headers={"source": "<b>import</b>"})])
        stop_billing = threading.Event()
        with (
            Producer(client, ["orders", "payments"], batch=8, every_s=0.1),
            Producer(client, ["ledger"], batch=4, every_s=0.1, keyed=True),
            consuming(url, "charging", "payments", decline, consumer_id="charging-7f3a"),
            consuming(url, "posting", "ledger", post, consumer_id="posting-1", ordered=True),
            consuming(url, "posting", "ledger", post, consumer_id="posting-2", ordered=True),
            consuming(url, "audit", "orders", post, consumer_id="audit-0c1d"),
        ):
            with consuming(url, "billing", "orders", post, consumer_id="billing-a41e"):
                stop_billing.wait(PHASE_S)
            stop_billing.wait(PHASE_S)  # billing is away: its backlog rises
            client.split_partition("ledger", partition=3, at=896)  # while keys flow
            with consuming(url, "billing", "orders", post, consumer_id="billing-b93c"):
                stop_billing.wait(PHASE_S)  # and falls
                with sync_playwright() as playwright:
                    browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
                    page = browser.new_page(viewport={"width": 1280, "height": 860})
                    for name, where, ready in PAGES:
                        shoot(page, f"{url}/console{where}", name, out, ready=ready)
                    browser.close()


if __name__ == "__main__":
    main()
