"""The format package stands alone: the reconciliation ships it to Spark executors.

Read from the source with ``ast``: a module of ``qmq_broker.format`` imports nothing of the
broker but ``qmq_broker.errors`` and the package's own modules before it (files, frames,
messages, actions, index, ids, schedule), and of the other qmq packages only the message
record layout it shares with the SDK (``qmq_wire.records``: pure, standard library only).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qmq_broker.format

PACKAGE = Path(qmq_broker.format.__file__).parent
ORDER = ["files", "frames", "messages", "actions", "index", "ids", "schedule", "__init__"]


def qmq_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0].startswith("qmq_")}


def test_every_module_of_the_package_is_in_the_order() -> None:
    assert sorted(path.stem for path in PACKAGE.glob("*.py")) == sorted(ORDER)


@pytest.mark.parametrize("module", ORDER)
def test_a_format_module_imports_only_errors_and_the_modules_before_it(module: str) -> None:
    below = {f"qmq_broker.format.{name}" for name in ORDER[: ORDER.index(module)]}
    allowed = below | {"qmq_broker.errors", "qmq_wire.records"}
    assert qmq_imports(PACKAGE / f"{module}.py") <= allowed
