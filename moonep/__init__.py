"""MoonEP: perfectly balanced expert-parallel dispatch/combine for MoE training.

Public API (imported lazily, so ``import moonep.cli`` stays light): ``Buffer`` (dispatch, combine,
prefetch_weight, reduce_grad), ``CommPlan``, the differentiable ``dispatch`` / ``combine``, the ``MoE`` layer
and its ``SigmoidTopKRouter``. Adapters live in ``moonep.compat``. See ``moonep/README.md``.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Buffer": ("moonep.buffer", "Buffer"),
    "CommPlan": ("moonep.layout", "CommPlan"),
    "dispatch": ("moonep.autograd", "dispatch"),
    "combine": ("moonep.autograd", "combine"),
    "MoE": ("moonep.moe", "MoE"),
    "SigmoidTopKRouter": ("moonep.moe", "SigmoidTopKRouter"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    """PEP 562: resolve the public names on first use (torch is imported only then)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'moonep' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
