"""`make demo` in its short mode: the verdict is read from its output and its files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_demo_short_mode_ends_clean(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--short", "--dir", str(tmp_path / "demo")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    verdict = json.loads((tmp_path / "demo" / "verdict.json").read_text())
    placed = verdict["orders_placed"]
    assert placed == 120
    assert verdict["ok"] is True
    assert verdict["outbox_pending"] == 0
    # order.created + order.payment_due per order, order.paid or order.cancelled per order,
    # and two order.state changes per order
    assert verdict["messages_committed"] == 5 * placed
    assert verdict["messages_stored"] == verdict["messages_committed"]
    assert verdict["invoices"] == placed
    assert verdict["notifications_email"] == verdict["notifications_sms"] == placed
    assert verdict["orders_paid"] + verdict["orders_cancelled"] == placed
    assert verdict["orders_cancelled"] > 0
    assert verdict["reconciliation_exit_code"] == 0
    # the ordered subject, split while it ran: every order's states in order, none out
    assert verdict["orders_states_in_order"] == placed
    assert verdict["orders_states_out_of_order"] == 0
    assert verdict["reconciliation_out_of_order"] == 0
    assert verdict["reconciliation_acked_out_of_order"] == 0
    categories = verdict["reconciliation_categories"]
    assert categories["delivered"] == 5 * placed
    assert sum(v for k, v in categories.items() if k != "delivered") == 0
    assert any("broker killed" in e for e in verdict["events"])
    assert any("consumer b1 killed" in e for e in verdict["events"])
    assert any("order.state partition 0 split" in e for e in verdict["events"])
    assert "ALL GOOD" in output
    assert "reconciliation: clean" in output
    assert (tmp_path / "demo" / "report" / "report.html").exists()
