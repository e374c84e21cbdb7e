"""Package attributes imported when first used (a module ``__getattr__``, PEP 562), so
that importing a package does not import its heavy or optional parts up front."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_attributes(
    package: str, names: Mapping[str, Sequence[str]], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` that imports a name of ``names[module]`` from that
    module and keeps it in ``namespace`` (the package's ``globals()``), a plain attribute
    from then on. ``names`` is laid out as the package's ``TYPE_CHECKING`` imports are."""
    modules = {name: module for module, some in names.items() for name in some}

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
