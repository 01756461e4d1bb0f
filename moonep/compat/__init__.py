"""Drop-in adapters for code written against other EP libraries.

``moonep.compat.deepep.Buffer`` (DeepEP V1 normal mode) and ``moonep.compat.megatron.MoonEPTokenDispatcher``
(megatron-core's six-stage token dispatcher, with ``MoonEPDispatcherConfig`` and ``SequentialExperts``); the
Megatron names are also importable from here, resolved on first use (torch is imported only then).
"""
from __future__ import annotations

_LAZY = {
    "MoonEPTokenDispatcher": ("moonep.compat.megatron", "MoonEPTokenDispatcher"),
    "MoonEPDispatcherConfig": ("moonep.compat.megatron", "MoonEPDispatcherConfig"),
    "SequentialExperts": ("moonep.compat.megatron", "SequentialExperts"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    """PEP 562: resolve the adapter names on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'moonep.compat' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
