"""Where the browser tier finds Chromium, and the broker options its pages need."""

from __future__ import annotations

import os
from pathlib import Path

CHROMIUM = Path(os.environ.get("QMQ_CHROMIUM", "/usr/bin/chromium"))
"""Debian's Chromium (``scripts/ensure-chromium.sh``); Playwright downloads no browser."""
SAMPLE_ARGS = ["--console-sample-interval", "1s"]
"""The console's rates and charts fill in test time."""
