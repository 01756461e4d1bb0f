"""MoonEP: perfectly balanced expert-parallel dispatch/combine for MoE training.

Public API (imported lazily, so ``import moonep.cli`` stays light): ``Buffer`` (dispatch, combine,
redispatch, prefetch_weight, reduce_grad), ``CommPlan``, ``EPGeometry``, the differentiable ``dispatch`` /
``combine``, the one EP step (``routed_experts``, or its phases ``ep_dispatch`` / ``ep_experts`` /
``ep_combine``), the ``MoE`` layer and its ``SigmoidTopKRouter``,
``measure_cost_model`` (cost-aware balancing). Adapters live in ``moonep.compat``. See
``moonep/README.md``.
"""

from __future__ import annotations

from moonep_base import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "Buffer": ("moonep.buffer", "Buffer"),
    "CommPlan": ("moonep.comm_plan", "CommPlan"),
    "EPGeometry": ("moonep.geometry", "EPGeometry"),
    "dispatch": ("moonep.autograd", "dispatch"),
    "combine": ("moonep.autograd", "combine"),
    "MoE": ("moonep.moe", "MoE"),
    "SigmoidTopKRouter": ("moonep.router", "SigmoidTopKRouter"),
    "grouped_experts": ("moonep.experts", "grouped_experts"),
    "routed_experts": ("moonep.ep_step", "routed_experts"),
    "ep_dispatch": ("moonep.ep_step", "ep_dispatch"),
    "ep_experts": ("moonep.ep_step", "ep_experts"),
    "ep_combine": ("moonep.ep_step", "ep_combine"),
    "EPRows": ("moonep.ep_step", "EPRows"),
    "GatedActivation": ("moonep.expert_math", "GatedActivation"),
    "measure_cost_model": ("moonep.cost", "measure_cost_model"),
    "expert_parameters": ("moonep.parallel", "expert_parameters"),
    "ignore_in_ddp": ("moonep.parallel", "ignore_in_ddp"),
    "scale_expert_grads": ("moonep.parallel", "scale_expert_grads"),
}

__all__ = ["__version__", *_LAZY]  # pyright: ignore[reportUnsupportedDunderAll]  # the lazy table's names

# PEP 562: the public names resolve on first use (torch is imported only then)
__getattr__, __dir__ = lazy_exports("moonep", _LAZY, globals())
