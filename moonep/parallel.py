"""The parallelism contract: expert parameters are owned by one EP rank each, so data parallelism must leave them alone.

Expert weights differ per rank (rank r holds experts ``[r*epn, (r+1)*epn)``), and their gradients are already
complete after the backward: the EP exchanges bring every token's contribution, from every rank of the EP
group, to the expert's owner. A data-parallel wrapper that treats them as replicated corrupts training silently:
DDP broadcasts rank 0's experts to every rank at construction and averages expert gradients across ranks; FSDP
shards them. So:

- ``expert_parameters(model)``: the parameters to keep out of DDP / FSDP (``ignore_in_ddp(model)`` does it for
  DDP before wrapping; FSDP2: ``fully_shard(model, ignored_params=set(expert_parameters(model)))``);
- **gradient convention**: an expert's gradient is the gradient of the SUM of every EP rank's loss. Under
  mean-reduced data parallelism over the same ranks (each rank's loss a mean over its own tokens, DDP averaging
  the rest), the model's loss is that sum divided by the DP size: call ``scale_expert_grads(model, 1 / dp)``
  after the backward (or scale the loss and not DDP's other gradients, which DDP already averages);
- every MoE layer checks on its first forward that it is not inside a DDP wrapper that replicates its experts,
  and that FSDP has not turned them into sharded DTensors, and raises a ValueError that says what to do.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

EXPERT_ATTR = "_moonep_expert"
"""Attribute set (True) on every expert-parallel parameter: one EP rank's experts, not replicated."""


def mark_expert(*params: nn.Parameter) -> None:
    """Mark parameters as expert-parallel (each rank holds different experts)."""
    for p in params:
        setattr(p, EXPERT_ATTR, True)


def is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, EXPERT_ATTR, False))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of ``model`` (in ``named_parameters`` order): keep them out of DP wrappers."""
    return [p for p in model.parameters() if is_expert(p)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if is_expert(p)]


def ignore_in_ddp(model: nn.Module) -> list[str]:
    """Tell DDP (call BEFORE wrapping) to neither broadcast nor all-reduce the expert parameters; returns their
    names. ``DistributedDataParallel(model, ...)`` then replicates only the rest."""
    names = expert_parameter_names(model)
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


@torch.no_grad()
def scale_expert_grads(model: nn.Module, factor: float) -> None:
    """Multiply every expert gradient by ``factor`` (``1 / dp`` under mean-reduced data parallelism)."""
    for p in expert_parameters(model):
        if p.grad is not None:
            p.grad.mul_(factor)


def check_not_replicated(layer: nn.Module) -> None:
    """Raise if ``layer``'s expert parameters are replicated by a data-parallel wrapper: a DDP instance on the call
    stack (its forward is running this layer) that does not ignore them, or FSDP's sharded DTensors."""
    mine = [p for p in layer.parameters() if is_expert(p)]
    if any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in mine):
        raise ValueError(
            "moonep: expert parameters were sharded by FSDP; each EP rank owns its experts: pass "
            "ignored_params=set(moonep.expert_parameters(model)) to fully_shard"
        )
    ddp_type, ours = torch.nn.parallel.DistributedDataParallel, {id(p) for p in mine}
    frame = sys._getframe(1)
    while frame is not None:
        wrapper = frame.f_locals.get("self")
        if isinstance(wrapper, ddp_type):
            ignored = set(getattr(wrapper, "parameters_to_ignore", ()))
            bad = [n for n, p in wrapper.module.named_parameters() if id(p) in ours and n not in ignored]
            if bad:
                raise ValueError(
                    f"moonep: DistributedDataParallel replicates expert parameters {bad[:3]}: it broadcasts rank "
                    f"0's experts and averages their grads. Call moonep.ignore_in_ddp(model) before wrapping "
                    f"(and moonep.scale_expert_grads(model, 1 / dp) after backward; see moonep/README.md)"
                )
            return
        frame = frame.f_back


__all__ = [
    "expert_parameters",
    "expert_parameter_names",
    "ignore_in_ddp",
    "scale_expert_grads",
    "check_not_replicated",
    "mark_expert",
]
