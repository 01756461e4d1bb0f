"""Drop-in adapters for code written against other EP libraries.

``moonep.compat.deepep`` (DeepEP V1 normal mode: ``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t``),
``moonep.compat.deepep_v2`` (DeepEP V2: ``ElasticBuffer``, ``EPHandle``; also reachable as ``deepep.ElasticBuffer``
as in ``deep_ep`` 2.x) and ``moonep.compat.megatron.MoonEPTokenDispatcher`` (megatron-core's six-stage token
dispatcher, with ``MoonEPDispatcherConfig`` and ``SequentialExperts``); the Megatron names are also importable
from here, resolved on first use (torch is imported only then).
"""

from __future__ import annotations

from moonep_base import lazy_exports

_LAZY = {
    "MoonEPTokenDispatcher": ("moonep.compat.megatron", "MoonEPTokenDispatcher"),
    "MoonEPDispatcherConfig": ("moonep.compat.megatron", "MoonEPDispatcherConfig"),
    "SequentialExperts": ("moonep.compat.megatron", "SequentialExperts"),
}

__all__ = list(_LAZY)  # pyright: ignore[reportUnsupportedDunderAll]  # the lazy table's names

# PEP 562: the adapter names resolve on first use
__getattr__, __dir__ = lazy_exports("moonep.compat", _LAZY, globals())
