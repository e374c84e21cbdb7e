"""The broker's floors read top-down: a module imports only modules of its own floor or below
(read from the source with ``ast``; every import statement counts, under ``TYPE_CHECKING``
too), and no two folders import each other.

The one import allowed to run back up: ``http.app`` names ``Broker`` in ``create_app``'s
signature (under ``TYPE_CHECKING``), to unpack it into the services the routes call.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "qmq_broker"

# Lowest first; a folder is one floor, and a module takes its longest matching prefix.
FLOORS: dict[int, tuple[str, ...]] = {
    0: ("errors", "clock", "format", "logs", "memory", "config", "messages", "answer_fields"),
    1: ("storage",),  # disk primitives
    2: ("dedup",),
    3: ("subjects", "groups"),
    4: ("actions", "metrics", "lifecycle", "routebook"),
    5: ("pulls",),
    6: ("delayed",),
    7: ("produce", "delivery", "resets", "ordered", "stats", "maintenance"),
    8: ("recovery",),  # recovery, migration, index repair, verify and repair
    9: ("console",),
    10: ("services",),
    11: ("http",),
    12: ("engine",),
    13: ("server",),
    14: ("cli", "__init__"),
}
ALLOWED_UP = {("http.app", "engine")}


def floor(module: str) -> int:
    hits = [
        (len(prefix), number)
        for number, prefixes in FLOORS.items()
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert hits, f"qmq_broker.{module} has no floor: add it to FLOORS"
    return max(hits)[1]


def imports() -> set[tuple[str, str]]:
    """(importer, imported) for every import of one broker module by another."""
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        importer = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                if node.module == "qmq_broker":
                    found.update((importer, alias.name) for alias in node.names)
                elif node.module.startswith("qmq_broker."):
                    found.add((importer, node.module.removeprefix("qmq_broker.")))
            elif isinstance(node, ast.Import):
                found.update(
                    (importer, alias.name.removeprefix("qmq_broker."))
                    for alias in node.names
                    if alias.name.startswith("qmq_broker.")
                )
    return found


def test_no_import_runs_back_up_a_floor() -> None:
    up = {(a, b) for a, b in imports() if floor(b) > floor(a)}
    assert up == ALLOWED_UP


def test_no_two_folders_import_each_other() -> None:
    between = {(a.split(".")[0], b.split(".")[0]) for a, b in imports()}
    both_ways = {tuple(sorted((a, b))) for a, b in between if a != b and (b, a) in between}
    assert both_ways == set()
