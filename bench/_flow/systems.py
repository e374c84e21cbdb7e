"""The systems by name; each module is imported when first asked for, so that a run
without a system does not need its library."""

from __future__ import annotations

import importlib

from bench._flow.common import System

MODULES = {
    "qmq": "qmq",
    "pgqueuer": "pgq",
    "procrastinate": "procq",
    "tablequeue": "tableq",
    "plain": "plain",
    "onerow": "onerow",
}


def system(name: str) -> System:
    found: System = importlib.import_module(f"bench._flow.{MODULES[name]}").SYSTEM
    return found
