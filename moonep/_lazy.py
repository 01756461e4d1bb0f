"""PEP 562 lazy exports for moonep's packages: public names resolve on first use, so importing the package (the
command line, ``moonep --help``) does not load torch."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, tuple[str, str]], namespace: dict):
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a public name to ``(module, attribute)``; a
    resolved name is cached in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = table[name]
        value = getattr(importlib.import_module(module), attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
