"""PEP 562 lazy exports: a package's public names resolve on first use, so importing the package (its command line,
``moonep --help``) loads none of what they need (torch). The one copy of the recipe: ``moonep``, ``moonep.compat``,
``cp_kda`` and ``k3`` use it.

    _EXPORTS = {"kda_chunk": ".chunk", "Buffer": ("moonep.buffer", "Buffer")}
    __all__ = list(_EXPORTS)
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

Target = str | tuple[str, str]
"""Where a public name lives: ``"module"`` (the attribute of the same name) or ``("module", "attribute")``; a
module name starting with ``.`` is relative to the package."""


def lazy_exports(
    package: str, table: Mapping[str, Target], namespace: dict
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``): ``table`` maps each public name to where it
    lives; a resolved name is cached in ``namespace`` (the package's ``globals()``), so it resolves once."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = table[name]
        module, attr = (target, name) if isinstance(target, str) else target
        value = getattr(importlib.import_module(module, package), attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
