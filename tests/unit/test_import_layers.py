"""Which part may import which, read from the source with ``ast`` (nothing is imported).

``qmq_wire`` is the ground; the CLI's ground helpers (``qmq_cli.options``,
``qmq_cli.failures``) stand beside it; the SDK (``qmq_outbox``) and the broker
(``qmq_broker``) stand side by side on both, neither importing the other; the
reconciliation (``qmq_reconcile``) reads the broker's format and the SDK's envelope
headers; the ``qmq`` command (``qmq_cli.main``) is composed at the top. Every import
statement counts, inside functions and under ``TYPE_CHECKING`` too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("qmq_wire", "qmq_cli", "qmq_outbox", "qmq_broker", "qmq_reconcile")
GROUND_CLI = ("qmq_cli.options", "qmq_cli.failures")
TOP = ("qmq_cli.main", "qmq_cli.__main__")

# What each part may import of the others (a name, or a module under it).
ALLOWED = {
    "qmq_wire": (),
    "qmq_outbox": ("qmq_wire", *GROUND_CLI),
    "qmq_broker": ("qmq_wire", *GROUND_CLI),
    "qmq_reconcile": (
        "qmq_wire",
        *GROUND_CLI,
        "qmq_broker.format",  # the segment reader (a module or a package)
        "qmq_broker.errors",  # CorruptRecord, which the reader raises
        "qmq_outbox.envelope",  # parse_timestamp, for JetStream headers
        "qmq_outbox.transports.headers",  # the envelope's JetStream header names
    ),
}
# ``python -m qmq_outbox`` runs the whole ``qmq``: an entry point that nothing imports.
ENTRY_POINTS = {"qmq_outbox.__main__": TOP}

_MODULE_PATH = re.compile(r"^qmq_[a-z]+(\.\w+)*")


class Module(NamedTuple):
    name: str  # dotted
    tree: ast.Module
    is_package: bool  # an __init__.py: its relative imports start from itself


def modules(package: str) -> Iterator[Module]:
    """Every module of ``package``, parsed."""
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        yield Module(name, ast.parse(path.read_text(), filename=str(path)), is_package)


def imported(module: Module) -> Iterator[tuple[int, set[str]]]:
    """(line, the names one import could bring in) for each imported name: ``import a.b``
    gives {a.b}; ``from a import b`` gives {a, a.b}, since ``b`` may be a module."""
    name, tree, is_package = module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, {alias.name}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                yield node.lineno, {base, f"{base}.{alias.name}"}


def under(name: str, allowed: tuple[str, ...]) -> bool:
    return any(name == entry or name.startswith(entry + ".") for entry in allowed)


def other_parts(own: str, names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in PARTS and n.split(".")[0] != own}


def breaches(package: str, allowed: tuple[str, ...]) -> list[str]:
    """Each import in ``package`` of another part that no entry of ``allowed`` covers."""
    found = []
    for module in modules(package):
        permitted = allowed + ENTRY_POINTS.get(module.name, ())
        for line, names in imported(module):
            foreign = other_parts(package, names)
            if foreign and not any(under(n, permitted) for n in names):
                found.append(f"{module.name}:{line} imports {min(foreign)}")
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_part_imports_only_what_stands_below_it(package: str) -> None:
    assert breaches(package, ALLOWED[package]) == []


def test_the_sdk_and_the_broker_do_not_import_each_other() -> None:
    for package, other in (("qmq_outbox", "qmq_broker"), ("qmq_broker", "qmq_outbox")):
        for module in modules(package):
            for line, names in imported(module):
                assert not any(n.split(".")[0] == other for n in names), f"{module.name}:{line}"


def test_the_cli_ground_imports_no_part() -> None:
    for module in modules("qmq_cli"):
        if module.name in TOP:
            continue
        for line, names in imported(module):
            where = f"{module.name}:{line}"
            assert not other_parts("qmq_cli", names), f"{where} imports {names}"
            assert not any(under(n, TOP) for n in names), f"{where} imports the top"


def test_the_qmq_command_imports_each_part_only_when_its_subcommand_runs() -> None:
    """A module-level import of a part would make every subcommand need every extra."""
    (main,) = (module for module in modules("qmq_cli") if module.name == "qmq_cli.main")
    at_load = ast.Module(
        body=[n for n in main.tree.body if not isinstance(n, ast.FunctionDef)], type_ignores=[]
    )
    for line, names in imported(main._replace(tree=at_load)):
        assert not other_parts("qmq_cli", names), f"qmq_cli.main:{line} imports {names}"
    loaded = {n for _, names in imported(main) for n in other_parts("qmq_cli", names)}
    assert {n.split(".")[0] for n in loaded} == {"qmq_outbox", "qmq_broker", "qmq_reconcile"}


def _loads_by_name(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                return True
    return False


def _module_strings(tree: ast.Module) -> set[str]:
    """Every string literal (and f-string's literal part) that reads as a qmq module path."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _MODULE_PATH.match(node.value)
            if match and "." in match.group(0):
                found.add(match.group(0))
    return found


@pytest.mark.parametrize("package", PARTS)
def test_no_module_loads_another_part_by_name(package: str) -> None:
    """``importlib`` may load a module of the same part lazily, never another part's
    (the ``qmq`` command once loaded the broker's and the reconciliation's CLIs so)."""
    for module in modules(package):
        if not _loads_by_name(module.tree):
            continue
        for path in _module_strings(module.tree):
            assert path.split(".")[0] == package, f"{module.name} loads {path} by name"
            assert not re.search(r"(^|\.|_)cli(\.|$)", path), f"{module.name} loads a CLI: {path}"
