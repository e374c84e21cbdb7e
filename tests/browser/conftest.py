"""The browser tier: Playwright (Python) driving Debian's Chromium against real brokers.

No browser is downloaded: Chromium comes from Debian (``scripts/ensure-chromium.sh``, run by
``make test``), at ``/usr/bin/chromium`` or ``QMQ_CHROMIUM``. Without it the tier is
skipped, and with ``CI=true`` it fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.browser.chromium import CHROMIUM, SAMPLE_ARGS
from tests.support.broker_process import BrokerProcess

TIMEOUT_MS = 15_000


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        message = f"no Chromium at {CHROMIUM}: run scripts/ensure-chromium.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return str(CHROMIUM)


@pytest.fixture(scope="module")
def browser(chromium_path: str) -> Iterator[Browser]:
    """One Chromium per test module. Not per session: Playwright's sync API keeps its
    event loop running on this thread while it is open, and the asyncio tests of the
    tiers after this one need the thread's loop free."""
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium_path, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab (its own sessionStorage); a script error or a CSP violation fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    problems: list[str] = []
    tab.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    tab.on(
        "console",
        lambda message: (
            problems.append(f"console: {message.text}")
            if "Content Security Policy" in message.text
            else None
        ),
    )
    yield tab
    context.close()
    assert not problems, problems


@pytest.fixture
def console_broker(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> Callable[..., BrokerProcess]:
    """``console_broker(*extra_args, tokens=None)``: a broker sampling every second whose
    handlers' failures go to the dead letters at once (``--max-attempts 1``)."""

    def start(*extra: str, tokens: list[dict[str, object]] | None = None) -> BrokerProcess:
        args = [*SAMPLE_ARGS, "--max-attempts", "1", *extra]
        if tokens is not None:
            path = tmp_path / "tokens.json"
            path.write_bytes(orjson.dumps({"tokens": tokens}))
            args += ["--auth-file", str(path)]
        return broker_factory(tmp_path / "data", extra_args=args).start()

    return start
